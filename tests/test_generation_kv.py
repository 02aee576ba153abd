"""The key/value store's forecast of what its next step takes: the capacity its buffers grow
by and the largest buffer copied meanwhile, checked against what ``reserve`` then does; and
the positions a sliding-window buffer keeps as it slides."""

import torch

from models.causal.kv import FULL, WINDOW, KVStore


def buffers(store: KVStore) -> dict[tuple[int, int], torch.Tensor]:
    return {
        (seq_id, kind): buffer
        for seq_id, seq in store._seqs.items()
        for kind, buffer in ((FULL, seq.full), (WINDOW, seq.window))
        if buffer is not None
    }


def test_the_next_step_s_growth_is_what_reserve_allocates_plus_the_largest_copy():
    store = KVStore(
        num_layers=6, num_kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"),
        windows=[None, 16, 16, None, 16, 16],
    )  # fmt: skip
    lengths = {1: 40, 2: 130, 3: 7}
    for seq_id, length in lengths.items():
        store.reserve(seq_id, length, keep=0)
    changed_steps = 0
    for _ in range(300):
        forecast = store.growth_bytes()
        before_bytes, before = store.bytes_held, buffers(store)
        bases = {seq_id: seq.base for seq_id, seq in store._seqs.items()}
        for seq_id, length in lengths.items():
            store.reserve(seq_id, length + 1, keep=length)
            lengths[seq_id] = length + 1
        after = buffers(store)
        replaced = [b for key, b in before.items() if after[key] is not b]
        moved = [seq_id for seq_id, seq in store._seqs.items() if seq.base != bases[seq_id]]
        grown = sum(max(0, after[key].numel() - b.numel()) * 4 for key, b in before.items())
        assert store.bytes_held - before_bytes <= grown
        copied = max((b.numel() * 4 for b in replaced), default=0)
        if replaced:
            changed_steps += 1
            assert forecast >= grown + copied, (forecast, grown, copied)
            assert forecast <= grown + max(b.numel() * 4 for b in before.values())
        else:  # nothing, or the live positions moved to the front in place
            assert forecast == 0, (forecast, moved)
    assert changed_steps >= 5  # the full buffers grew, the window ones slid past the cap


def test_a_sliding_window_buffer_keeps_every_live_position_as_it_moves_them_in_place():
    window = 100
    store = KVStore(
        num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"),
        windows=[window, None],
    )  # fmt: skip
    seq = store.reserve(1, 1, keep=0)
    moves, length = 0, 1
    for step in (1, 1, 1, 37, 1, 250, *[1] * 400, 3, 90):  # decode tokens and prompt chunks
        buffer, base = seq.layer(WINDOW)
        # Each slot holds its own position, from the first a query can still see.
        for position in range(max(base, length - window), length):
            buffer[:, :, :, position - base] = position
        before, before_base = buffer, base
        seq = store.reserve(1, length + step, keep=length)
        buffer, base = seq.layer(WINDOW)
        moves += buffer is before and base != before_base
        live = range(max(base, length - window + 1), length)
        assert base <= live.start
        for position in live:
            assert (buffer[:, :, :, position - base] == position).all(), (step, position, base)
        length += step
    assert moves >= 3  # moved in place, not only replaced


def test_a_prompt_fed_in_chunks_has_its_buffers_sized_once_for_all_of_it():
    store = KVStore(
        num_layers=4, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"),
        windows=[None, 300, 300, None],
    )  # fmt: skip
    for prompt, window_slots in ((200, 256), (1000, store.window_tokens)):
        seq_id = prompt
        seen = []
        for start in range(0, prompt, 50):
            seq = store.reserve(seq_id, start + 50, keep=start, expect=prompt)
            seen.append((seq.full, seq.window))
        assert len({id(full) for full, _ in seen}) == 1  # allocated once, never copied
        assert seen[0][0].shape[3] >= prompt
        assert len({id(window) for _, window in seen if window is not None}) <= 2
        assert seen[0][1].shape[3] == window_slots  # the whole prompt, up to the cap
        # Without ``expect``, the same prompt's buffers grow (and are copied) chunk by chunk.
        for start in range(0, prompt, 50):
            seq = store.reserve(-seq_id, start + 50, keep=start)
            seen.append((seq.full, None))
        assert len({id(full) for full, _ in seen[len(seen) // 2 :]}) > 3
