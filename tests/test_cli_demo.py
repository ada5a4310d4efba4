"""`python -m canonical_ops demo`, run as a subprocess from the repository root, and the
README's ops quickstart.

A user error is exit status 2 with exactly one line on stderr, answered before any
work (a topology the model cannot have, a GPU that is not there, a region /dev/shm
cannot hold). The verdict is true: PASS only when every prompt page was loaded and
every head, token and layer is bit-exact; a reader set that misses heads, or a byte
that differs, FAILs and says so. Long phases print progress; ``--json`` prints one
object on stdout.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import torch
from helpers.demo_cli import ROOT, TINY, assert_usage_error, run_demo
from helpers.fleet_cli import MODEL as FLEET_MODEL
from helpers.fleet_cli import run_fleet

from canonical_ops.demo import config as demo_config
from canonical_ops.demo import report, truth
from canonical_ops.demo.cli import build_parser
from canonical_ops.demo.presets import PRESETS
from canonical_ops.demo.ranks import GroupRun
from layouts import LayerSpec, RankContext, certification_failure

# ------------------------------------------------------------------------ item 10: bad input

BAD_INPUTS = [
    (["--writer-tp", "0"], ["--writer-tp"]),
    (["--reader-tp", "-2"], ["--reader-tp"]),
    (["--writer-tp", "1.5"], ["--writer-tp", "'1.5'"]),
    (["--writer-tp", "100000"], ["--writer-tp"]),
    (["--layers", "0"], ["--layers"]),
    (["--layers", "2.5"], ["--layers"]),
    (["--prompt-tokens", "0"], ["--prompt-tokens"]),
    (["--prompt-tokens", "1e9"], ["--prompt-tokens"]),
    (["--prompt-tokens", "1000000000"], ["--prompt-tokens", "1000000000"]),
    (["--timeout", "0"], ["--timeout"]),
    (["--timeout", "-5"], ["--timeout"]),
    (["--timeout", "nan"], ["--timeout"]),
    (["--seed", "-1"], ["--seed"]),
    (["--preset", "gpt-5"], ["--preset", "gpt-5"]),
    (["--order", "NDH"], ["--order"]),
    (["--packing", "interleaved"], ["--packing"]),
    (["--device", "tpu"], ["--device"]),
    (["--no-such-flag"], ["--no-such-flag"]),
    (["--writer-pp", "0"], ["--writer-pp"]),
    (["--reader-pp", "1.5"], ["--reader-pp"]),
    (["--writer-pp", "5"], ["--writer-pp 5", "4 layers"]),  # tiny has 4 layers
    (["--kv-heads", "0"], ["--kv-heads"]),
    (["--dtype", "int8"], ["--dtype"]),
    (["--phase", "read"], ["--phase read", "--store"]),
    (["--phase", "sideways", "--store", "/tmp"], ["--phase"]),
    (["--store-capacity", "1G"], ["--store-capacity", "--store"]),
    (["--store", "/tmp", "--store-capacity", "lots"], ["--store-capacity", "'lots'"]),
    (["--store", "/tmp", "--store", "/var/tmp"], ["--store", "at most one directory"]),
    (["--store", "s3://bucket"], ["--store s3://bucket", "directory or a redis:// URL"]),
    (["--model-name", " "], ["--model-name"]),
]


@pytest.mark.parametrize(("args", "words"), BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(args, words):
    assert_usage_error(run_demo(*TINY, *args), *words)


def test_usage_errors_are_answered_before_torch_loads():
    """A wrong flag or a topology the model cannot have is refused from the pure front end
    (flags, presets, layouts): torch and the engines are never imported for it."""
    code = (
        "import contextlib, io, sys\n"
        "from canonical_ops.demo import main\n"
        "for args in sys.argv[1:]:\n"
        "    with contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n"
        "            status = main(args.split())\n"
        "        except SystemExit as refused:  # argparse's usage error\n"
        "            status = refused.code\n"
        "    print(status, 'torch' in sys.modules)\n"
    )
    cases = [
        " ".join([*TINY, "--store", "/tmp", "--store-capacity", "lots"]),
        " ".join([*TINY, "--writer-tp", "3", "--reader-tp", "2"]),
        "--preset deepseek-v3 --writer-tp 65",
        " ".join([*TINY, "--writer-pp", "9"]),
    ]
    result = subprocess.run(
        [sys.executable, "-c", code, *cases], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:-1] == ["2 False"] * len(cases), result.stdout


def test_missing_or_unknown_command_is_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "canonical_ops"], cwd=ROOT, capture_output=True, text=True
    )
    assert_usage_error(result, "demo")
    result = subprocess.run(
        [sys.executable, "-m", "canonical_ops", "dmeo"], cwd=ROOT, capture_output=True, text=True
    )
    assert_usage_error(result, "dmeo")


def test_choices_are_case_insensitive():
    # Parsed (the topology, checked next, is what is refused), not "invalid choice".
    line = assert_usage_error(
        run_demo(
            "--preset",
            "TINY",
            "--order",
            "nhd",
            "--packing",
            "SPLIT",
            "--device",
            "CPU",
            "--writer-tp",
            "5",
        ),
        "--writer-tp 5",
    )
    assert "invalid choice" not in line
    line = assert_usage_error(run_demo("--preset", "DeepSeek-V3", "--writer-tp", "65"))
    assert "invalid choice" not in line and "--writer-tp" in line


def test_a_persistent_phase_uses_only_its_own_roles_flags():
    """A reader neither knows nor needs the topology that wrote the store (and vice versa)."""
    parse = build_parser().parse_args
    read = demo_config.build_config(
        parse([*TINY, "--store", "/x", "--phase", "read", "--writer-tp", "3"]), "cpu"
    )
    assert (read.writer_tp, read.reader_tp) == (2, 2)  # TP 3 is no topology of 8 heads: unused
    write = demo_config.build_config(
        parse([*TINY, "--store", "/x", "--phase", "write", "--reader-tp", "5", "--writer-pp", "2"]),
        "cpu",
    )
    assert (write.reader_tp, write.reader_pp) == (4, 2) == (write.writer_tp, write.writer_pp)
    with pytest.raises(demo_config.UsageError, match="--writer-tp 3"):  # both engines: checked
        demo_config.build_config(parse([*TINY, "--store", "/x", "--writer-tp", "3"]), "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_without_gpu_is_refused_in_the_parent():
    start = time.monotonic()
    assert_usage_error(run_demo(*TINY, "--device", "cuda"), "--device cuda", "no CUDA GPU")
    assert time.monotonic() - start < 60


def test_region_larger_than_dev_shm_is_refused_before_any_work():
    start = time.monotonic()
    line = assert_usage_error(
        run_demo("--preset", "llama3-70b", "--prompt-tokens", "16777216", "--device", "cpu"),
        "/dev/shm",
        "GiB",
    )
    assert "--prompt-tokens" in line
    assert time.monotonic() - start < 60  # not minutes of page bookkeeping


HYBRID = ["--preset", "tiny-hybrid", "--prompt-tokens", "40"]
HYBRID_BAD = [
    ([], ["--store DIR", "tiny-hybrid"]),
    (["--store", "/tmp", "--writer-tp", "3"], ["--writer-tp 3", "4 KV heads"]),
    (["--store", "/tmp", "--reader-tp", "32"], ["--reader-tp 32", "cannot be resharded"]),
    (["--store", "/tmp", "--layers", "4"], ["--layers", "hybrid"]),
    (["--store", "/tmp", "--kv-heads", "2"], ["--kv-heads", "hybrid"]),
    (["--store", "/tmp", "--dtype", "float16"], ["--dtype float16", "bfloat16"]),
    (["--store", "/tmp", "--order", "HND"], ["--packing/--order", "packed NHD"]),
    (["--store", "/tmp", "--device", "cuda"], ["--device cuda", "CPU"]),
]


@pytest.mark.parametrize(("args", "words"), HYBRID_BAD, ids=[" ".join(a) for a, _ in HYBRID_BAD])
def test_hybrid_bad_input_is_one_line_and_exit_2(args, words):
    assert_usage_error(run_demo(*HYBRID, *args), *words)


def test_hybrid_region_larger_than_dev_shm_is_refused_before_any_work(tmp_path):
    """Issue 26: the hybrid presets ran 23 s and died with a traceback (`can't allocate
    memory`) where the other presets refuse in one line; now the same pre-check."""
    start = time.monotonic()
    args = ["--preset", "qwen3-next-like", "--prompt-tokens", "16777216", "--store", str(tmp_path)]
    line = assert_usage_error(run_demo(*args), "--prompt-tokens 16777216", "/dev/shm", "GiB")
    assert "--layers" not in line  # a hybrid preset has no --layers to lower
    assert time.monotonic() - start < 60
    assert not list(tmp_path.iterdir())  # refused before the store was opened


def test_transfer_figures_say_what_they_are():
    """Issue 26: "load 3.04 GB/s (0.05x a plain copy)" from one timed transfer contradicted
    the README's benchmark tables; the lines now say what the figure is, with no ratio."""
    result = run_demo(*TINY, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    lines = [line for line in result.stderr.splitlines() if line.startswith(("store:", "load:"))]
    assert len(lines) == 2, result.stderr
    for line in lines:
        assert "plain copy" not in line and "x a " not in line, line
        assert "at once" in line and "one timed pass" in line and "not a benchmark" in line
    for kind in ("store", "load"):
        assert set(summary[kind]) == {"ranks", "bytes", "seconds", "gbps"}, summary[kind]


# --------------------------------------------------------------------- item 11: a true verdict


@pytest.mark.parametrize(
    ("writer_tp", "reader_tp", "refused"),
    [
        ("3", "2", "--writer-tp 3"),  # used to print only "canonical pages differ in size"
        ("6", "3", "--writer-tp 6"),  # used to print "verified: ... bit-exact", then FAIL
        ("3", "3", "--writer-tp 3"),  # used to PASS with heads 6-7 held by no rank
        ("4", "5", "--reader-tp 5"),
        ("16", "12", "--reader-tp 12"),
    ],
)
def test_topology_the_model_cannot_have_is_refused_with_the_reason(writer_tp, reader_tp, refused):
    line = assert_usage_error(
        run_demo(*TINY, "--writer-tp", writer_tp, "--reader-tp", reader_tp), refused
    )
    assert "8 KV heads" in line and "vLLM requires" in line
    tp = int(refused.split()[-1])
    spec = LayerSpec("full", 16, max(1, 8 // tp), 64, "float16", "packed", "NHD")
    reason = certification_failure(spec, RankContext(tp, 8, 0))
    assert reason and f"certification: {reason}" in line


def config(writer_tp=4, reader_tp=2, **overrides) -> demo_config.DemoConfig:
    fields = dict(
        attention="full",
        layers=2,
        total_kv_heads=8,
        head_size=8,
        dtype="float16",
        block_size=4,
        packing="packed",
        order="NHD",
        writer_tp=writer_tp,
        reader_tp=reader_tp,
        prompt_blocks=3,
        device="cpu",
        preset="tiny",
    )
    fields.update(overrides)
    return demo_config.DemoConfig(**fields)


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize(("packing", "order"), [("packed", "NHD"), ("split", "HND")])
def test_reader_ranks_together_hold_every_head(tp, packing, order):
    cfg = config(packing=packing, order=order)
    held = [cfg.global_heads(tp, rank) for rank in range(tp)]
    assert sorted({h for heads in held for h in heads}) == list(range(8))
    assert all(len(heads) == cfg.spec(tp).num_kv_heads for heads in held)


def reader_report(cfg: demo_config.DemoConfig, tp: int, rank: int, corrupt: bool = False) -> dict:
    """What a reader rank reports, from real caches filled from the truth."""
    kv = truth.allocate_kv(cfg, tp, torch.device("cpu"))
    blocks = truth.block_table(cfg, salt=2)
    for layer in range(cfg.layers):
        kv[layer][blocks] = truth.shard_of(cfg, truth.truth_layer(cfg, layer), tp, rank)
    if corrupt:
        block = kv[1][int(blocks[2])]  # a view: the write lands in the cache
        block[(0,) * (block.dim() - 1) + (5,)] ^= 0x0101  # both bytes of one element, layer 1
    check = truth.compare_with_truth(cfg, tp, rank, kv, blocks)
    state = dict(state_bytes_checked=0, state_bytes_wrong=0)
    return dict(pages=cfg.prompt_blocks, bytes=1, seconds=1.0, **check, **state)


def good_writers(cfg: demo_config.DemoConfig) -> GroupRun:
    written = dict(pages=cfg.prompt_blocks, bytes=1, seconds=1.0)
    return GroupRun("writer", cfg.writer_tp, {r: written for r in range(cfg.writer_tp)})


@pytest.mark.parametrize(
    ("packing", "order", "attention", "heads", "head_size"),
    [
        ("packed", "NHD", "full", 8, 8),
        ("split", "HND", "full", 8, 8),
        ("packed", "HND", "full", 2, 8),
        ("packed", "NHD", "mla", 1, 24),
    ],
)
def test_verify_passes_only_bit_exact_full_coverage(packing, order, attention, heads, head_size):
    cfg = config(
        packing=packing,
        order=order,
        attention=attention,
        total_kv_heads=heads,
        head_size=head_size,
        reader_tp=4,
    )
    reports = {rank: reader_report(cfg, 4, rank) for rank in range(4)}
    good = report.verify(cfg, good_writers(cfg), 3, GroupRun("reader", 4, reports))
    assert good.failures == [] and good.bytes_wrong == 0
    assert (good.pages_loaded, good.pages_missed) == (3, 0)
    assert (
        good.bytes_checked
        == 4
        * cfg.layers
        * 3
        * cfg.block_size
        * len(cfg.global_heads(4, 0))
        * (head_size if attention == "mla" else 2 * head_size)
        * 2
    )

    reports[2] = reader_report(cfg, 4, 2, corrupt=True)
    bad = report.verify(cfg, good_writers(cfg), 3, GroupRun("reader", 4, reports))
    assert bad.bytes_wrong == 2
    assert any("reader rank 2: layers [1] differ" in f for f in bad.failures), bad.failures


def test_verify_fails_when_heads_are_held_by_no_reader():
    """The old demo's TP=3 readers held heads 0-5 only and still printed PASS."""
    cfg = config(reader_tp=4)
    reports = {rank: reader_report(cfg, 4, rank) for rank in range(3)}  # rank 3 (heads 6-7) lost
    readers = GroupRun("reader", 3, reports)  # as if the group had 3 ranks
    result = report.verify(cfg, good_writers(cfg), 3, readers)
    assert result.bytes_wrong == 0
    assert any("KV heads [6, 7] were held by no reader rank" in f for f in result.failures)


def test_verify_fails_on_missing_pages_and_failed_ranks():
    cfg = config(reader_tp=2)
    reports = {rank: reader_report(cfg, 2, rank) for rank in range(2)}
    for reported in reports.values():
        reported["pages"] = reported["blocks"] = 2  # only 2 of the 3 pages were ready
    writers = good_writers(cfg)
    writers.errors[1] = "Traceback ...\nRuntimeError: boom"
    result = report.verify(cfg, writers, 2, GroupRun("reader", 2, reports))
    assert (result.pages_loaded, result.pages_missed) == (2, 1)
    assert "writer rank 1 failed: RuntimeError: boom" in result.failures
    assert any("only 2/3 prompt pages became ready" in f for f in result.failures)

    readers = GroupRun("reader", 2, {0: reports[0]}, {1: "no report within --timeout 1 s"})
    result = report.verify(cfg, good_writers(cfg), 3, readers)
    assert result.pages_loaded == 0 and result.pages_missed == 3
    assert "reader rank 1 failed: no report within --timeout 1 s" in result.failures


# ------------------------------------------------------- item 12: progress, --json, --help


def test_help_shows_defaults_and_presets():
    result = run_demo("--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for name, preset in PRESETS.items():
        assert f"{name} {preset.describe()}" in text, name
    assert "llama3-8b full attention, 32 layers, 8 KV heads x 128, bfloat16, block 16" in text
    assert "deepseek-v3 mla attention, 61 layers, 1 latent x 576, bfloat16, block 64" in text
    for default in ("(default: 4)", "(default: 2)", "(default: 2048)", "(default: llama3-8b)"):
        assert default in text, default


PROGRESS = re.compile(r"^\[\s*\d+\.\d s\] ", re.MULTILINE)


@pytest.mark.slow
def test_cross_topology_json_run_passes():
    """Replicated heads (TP=16 over 8 heads) stored, read by TP=2, split HND; one JSON object."""
    result = run_demo(
        *TINY,
        "--writer-tp",
        "16",
        "--reader-tp",
        "2",
        "--packing",
        "split",
        "--order",
        "hnd",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)  # the whole of stdout is one object
    assert summary["verdict"] == "PASS" and summary["failures"] == []
    assert (summary["pages_loaded"], summary["pages_missed"], summary["bytes_wrong"]) == (2, 0, 0)
    assert summary["pages_total"] == summary["pages_ready"] == 2
    assert summary["bytes_checked"] == 2 * 4 * 2 * 16 * 8 * 128  # readers x layers x pages ...
    assert summary["topology"] == dict(
        writer_tp=16,
        reader_tp=2,
        writer_pp=1,
        reader_pp=1,
        writer_stages=[[0, 4]],
        reader_stages=[[0, 4]],
        device="cpu",
        format_id="v1-hnd",
        parallelism_agnostic=True,
    )
    assert summary["phase"] == "shared-memory" and "tiers" not in summary
    assert summary["model"]["packing"] == "split" and summary["model"]["layers"] == 4
    for kind in ("store", "load"):
        assert summary[kind]["bytes"] > 0 and summary[kind]["gbps"] > 0
    timings = summary["timings_s"]
    assert set(timings) == {"spawn_writers", "store", "spawn_readers", "load", "verify", "total"}
    assert all(v is not None and v >= 0 for v in timings.values())
    # Progress and the human report went to stderr.
    for phase in (
        "writers: spawning 16",
        "stored their share",
        "readers: 2/2 loaded",
        "compared with the unsharded truth",
    ):
        assert phase in result.stderr, phase
    assert len(PROGRESS.findall(result.stderr)) >= 7
    assert "PASS" in result.stderr


@pytest.mark.slow
def test_mla_run_prints_progress_and_pass():
    result = run_demo(
        "--preset",
        "deepseek-v3",
        "--layers",
        "2",
        "--prompt-tokens",
        "64",
        "--writer-tp",
        "4",
        "--reader-tp",
        "1",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "PASS"
    progress = PROGRESS.findall(result.stdout)
    assert len(progress) >= 7, result.stdout
    assert "verified: 1/1 pages loaded by every reader; the latent x 64 tokens x 2 layers" in (
        result.stdout
    )
    assert result.stderr == ""


# ------------------------------------------------------------- item 13: README ops quickstart


def test_readme_ops_quickstart_runs_and_prints_what_it_shows():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Ops quickstart\n", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    shown = section.split("```text\n", 1)[1].split("```", 1)[0]
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == shown
    assert "True" in shown
    assert time.monotonic() - start < 60


def test_names_and_paths_are_escaped_in_the_printed_lines_and_exact_in_json(tmp_path):
    """A model name, revision and store path holding a newline, a forged line and terminal
    escapes: the header and progress lines show them escaped; the JSON keeps them exact."""
    from helpers.hostile import ESCAPED, HOSTILE, assert_no_forgery

    store = tmp_path / f"store {HOSTILE}"
    names = ["--model-name", HOSTILE, "--model-revision", HOSTILE]
    result = run_demo(*TINY, "--store", str(store), *names, "--json")
    assert result.returncode == 0, result.stderr[-4000:]
    assert_no_forgery(result.stderr)
    assert f"store: {tmp_path}/store {ESCAPED}; phase both" in result.stderr
    assert f"({ESCAPED}@{ESCAPED})" in result.stderr
    summary = json.loads(result.stdout)
    assert (summary["model"]["name"], summary["model"]["revision"]) == (HOSTILE, HOSTILE)
    assert summary["stores"] == [str(store)]


def test_failure_lines_are_escaped():
    """A failure quoting an error (a path, a name) is one escaped FAIL line."""
    import io

    from helpers.hostile import HOSTILE, assert_no_forgery

    summary = dict(
        pages_total=2,
        pages_loaded=0,
        store=None,
        load=None,
        model=dict(attention="full", kv_heads=8, layers=4),
        verdict="FAIL",
        failures=[f"writer rank 0 failed: OSError: {HOSTILE}"],
        bytes_wrong=0,
        prompt_tokens=32,
    )
    out, err = io.StringIO(), io.StringIO()
    report.print_result(summary, out, err)
    assert_no_forgery(out.getvalue() + err.getvalue())
    assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("FAIL: writer rank 0")


# --------------------------------------------------------------------------- one prefix, every engine


def test_fleet_standalone_side_loads_what_the_demo_stored_and_says_what_missed(tmp_path):
    """The demo's write phase keys units with scheme v2 in the shared namespace: the one-prefix
    phase's standalone side (the demo's read engine) finds them at another TP; a unit that
    was never stored is a miss: its line says so and the exit status is 1."""
    store = str(tmp_path / "store")
    fleet_flags = ["--packing", "split", "--model-name", "canonical-kv-demo/one-prefix"]
    written = run_demo(
        *FLEET_MODEL, *fleet_flags, "--prompt-tokens", "48", "--store", store,
        "--phase", "write", "--writer-tp", "4",
    )  # fmt: skip
    assert written.returncode == 0, written.stderr[-3000:]
    loaded = run_fleet("standalone", "--store", store, "--tp", "2", "--load", "3")
    assert loaded["returncode"] == 0 and loaded["line"].startswith("standalone TP=2: ")
    assert (loaded["loaded"], loaded["missed"], loaded["wrong"]) == (3, 0, 0)
    assert loaded["checked"] == 3 * 2 * 16 * 8 * 64 * 2 * 2  # units x layers x tokens x KV
    missed = run_fleet("standalone", "--store", store, "--tp", "1", "--load", "4")
    assert missed["returncode"] == 1 and missed["verdict"] == "FAIL"
    assert (missed["loaded"], missed["missed"], missed["wrong"]) == (3, 1, 0)
    other = run_fleet("standalone", "--store", store, "--load", "3", "--model-name", "x/other")
    assert (other["returncode"], other["loaded"], other["missed"]) == (1, 0, 3)


@pytest.mark.parametrize(
    "args, words",
    [
        (["vllm", "--store", "/tmp/x", "--write", "0:2"], ["needs vLLM 0.33", ".venv-vllm"]),
        (["sglang", "--store", "/tmp/x", "--load", "2"], ["needs SGLang 0.5", ".venv-sglang"]),
        (["standalone", "--store", "/tmp/x"], ["standalone: expected --load N"]),
        (["vllm", "--store", "/tmp/x"], ["expected --load N, --write A:B"]),
        (["vllm", "--store", "/tmp/x", "--write", "3:3"], ["--write", "0 <= A < B"]),
        (["standalone", "--store", "/tmp/x", "--load", "2", "--preset", "deepseek-v3"],
         ["--preset deepseek-v3", "float16 or bfloat16", "llama3-8b"]),
        (["standalone", "--store", "/tmp/x", "--load", "2", "--preset", "llama3-8b-fp8"],
         ["--preset llama3-8b-fp8"]),
        (["standalone", "--store", "redis://127.0.0.1:1/0", "--load", "2"],
         ["--store redis://127.0.0.1:1/0", "no Redis server reachable"]),
    ],
)  # fmt: skip
def test_fleet_bad_input_is_one_line_and_exit_2(args, words):
    command = [sys.executable, "-m", "canonical_ops.demo.fleet", *args]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert_usage_error(result, *words)
