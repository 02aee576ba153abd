"""The key/value store's forecast of what its next step takes: the capacity its buffers grow
by and the largest buffer copied meanwhile, checked against what ``reserve`` then does."""

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
        elif moved:
            assert forecast > 0  # the live positions, copied to the front
        else:
            assert forecast == 0
    assert changed_steps >= 5  # the full buffers grew, the window ones slid past the cap
