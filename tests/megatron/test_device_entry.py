"""``python -m benchmarks.device``: its help lists every stage, one line each; every stage has
its --help; the options parse with their defaults and refuse bad values naming the option; a dry
run prints each stage's commands and writes nothing; a bound stops a command as ``timeout``
did; a run leaves a record with the command line, the commit, the card and the date."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import torch
from _device import run_stage

from benchmarks.device import cli, runner
from benchmarks.device.stages import STAGES

pytestmark = pytest.mark.bench  # the benchmark tooling (ADR 0038: --run-bench)

STAGE_FILES = sorted(p.stem for p in (Path(cli.__file__).parent / "stages").glob("[!_]*.py"))
NAMES = [stage.NAME for stage in STAGES]


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main(list(argv))
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_the_help_lists_every_stage_one_line_each(capsys):
    assert sorted(NAMES) == STAGE_FILES  # every stage module is registered, once
    text = _help(capsys, "--help")
    listing = text[text.index("stages:\n"):].splitlines()[1:len(NAMES) + 1]
    assert [line.split()[0] for line in listing] == NAMES, text
    for line, stage in zip(listing, STAGES, strict=True):
        assert line.split(None, 1)[1] == stage.HELP


# Ids that no marker's name matches (a stage named "te" would read as the te marker).
@pytest.mark.parametrize("name", NAMES, ids=[f"stage_{name}" for name in NAMES])
def test_every_stage_has_its_help(capsys, name):
    text = _help(capsys, name, "--help")
    stage = STAGES[NAMES.index(name)]
    assert f"usage: python -m benchmarks.device {name}" in text
    assert stage.__doc__.split("\n")[0] in text  # what it does and writes
    for common in ("--out", "--wheels", "--site", "--commit", "--dry-run"):
        assert common in text


def test_options_take_their_defaults():
    parse = cli.build_parser().parse_args
    rows = parse(["rows"])
    assert (rows.tokens, rows.seconds, rows.args) == (
        "8192,32768,32768:4096,131072:16384,131072", 270.0, [])
    assert rows.out.is_absolute() and rows.site == Path("/tmp/site")
    assert parse(["rows", "--args", "--tiny --cpu"]).args == ["--tiny", "--cpu"]
    assert rows.regimes == ["fresh", "coherent"]
    assert parse(["rows", "--regimes", "trained, fresh"]).regimes == ["trained", "fresh"]
    assert parse(["bench", "--run", "--sizes 8192", "--run=--profile"]).run == [
        ["--sizes", "8192"], ["--profile"]]
    assert parse(["sweep", "--variant", "", "--variant", "tree=.base"]).variant == [
        "", "tree=.base"]
    assert parse(["pretrain", "model.x=1"]).overrides == ["model.x=1"]
    assert parse(["quality_runs", "--regime", "8192:8192", "32768:32768"]).regime == [
        "8192:8192", "32768:32768"]


@pytest.mark.parametrize("argv, message", [
    (["rows", "--tokens", "8192,0"], "argument --tokens: '8192,0': expected comma-separated rows"),
    (["rows", "--seconds", "-5"], "argument --seconds: '-5': expected a positive number"),
    (["rows", "--regimes", "fresh,hot"], "argument --regimes: 'fresh,hot': expected a "
     "comma-separated list of fresh, coherent, trained"),
    (["peer", "--seconds", "90"], "argument --seconds: '90': expected more than 90 seconds"),
    (["quality_runs", "--regime", "8192"], "argument --regime: '8192': expected TRAINED:EVAL"),
    (["layer", "--args", "--steps 'x"], "argument --args: \"--steps 'x\": No closing quotation"),
    (["sweep", "--rounds", "0"], "argument --rounds: '0': expected a positive integer"),
    (["nonesuch"], "argument <stage>: invalid choice: 'nonesuch'"),
    ([], "the following arguments are required: <stage>"),
])
def test_bad_options_are_refused_by_name(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


#: What each stage's dry run must print (one string per command or file operation, in order).
DRY_RUNS = {
    "tests": ["NEMO_MSA_BENCH_TESTS=1 timeout -s INT -k 30 400 {py} -m pytest -v -m 'gpu or not "
              "slow' tests/core tests/msa_kernels --ignore tests/msa_kernels/"
              "test_long_sequences_gpu.py", "timeout -s INT -k 30 120 {py} -m pytest -q "
              "-m gpu tests/megatron tests/training"],
    "te_part": ["# copy {root}/.te/part*/* to /tmp/te/"],
    "te": ["# when transformer_engine does not import yet:",
           "bash {root}/.te/kit/install_te.sh /tmp/te {py} >> {out}/te_install.log",
           "FP8_CURVES_OUT={out}/fp8_curves.json timeout -s INT -k 30 420 {py} -m pytest -v -s "
           "tests/megatron/test_te_spec.py"],
    "bridge": ["{py} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
               "--upgrade --target /tmp/bsite",
               "PYTHONPATH=/tmp/bsite:{root} timeout -s INT -k 30 240 {py} -m pytest -q "
               "tests/megatron/test_bridge.py",
               "-m torch.distributed.run --nproc-per-node 1 benchmarks/bridge_msa.py pretrain "
               "--iters 40",
               "benchmarks/bridge_msa.py roundtrip"],
    "rows": ["timeout -k 30 270 {py} benchmarks/bench_layer.py --tokens 8192,32768,32768:4096,"
             "131072:16384,131072 --cases dense,msa_sparse_loss --index fresh", "--index coherent"
             " --no-attention-rows --steps 3 --warmup 2 --json {out}/rows_coherent.json"],
    "layer": ["timeout -k 30 540 {py} benchmarks/bench_layer.py --json {out}/layer.json >> "
              "{out}/layer.log 2>&1"],
    "sweep": ["# create {out}/sweep_json", "--cases dense,msa_sparse_loss --no-attention-rows "
              "--json {out}/sweep_json/1-0.json", "--cases msa_sparse_loss --no-attention-rows "
              "--json {out}/sweep_json/2-0.json", "# merge {out}/sweep_json/"],
    "profile": ["# remove /tmp/msa_profile_traces", "--profile --profile-top 30 --trace "
                "/tmp/msa_profile_traces --json {out}/profile.json", "{py} benchmarks/layer_bench/"
                "trace_attribution.py '/tmp/msa_profile_traces/msa_sparse_loss_<each>.json' --top"
                " 45 --against '/tmp/msa_profile_traces/dense_<each>.json'", "# gzip the traces"],
    "te_rows": ["--transformer-impl transformer_engine --tokens", "--transformer-impl "
                "transformer_engine --fp8 hybrid --tokens"],
    "long_tests": ["timeout -s INT -k 30 400 {py} -m pytest -v --durations=0 tests/msa_kernels/"
                   "test_long_sequences_gpu.py"],
    "long_rows": ["timeout -k 30 400 {py} benchmarks/bench_layer.py --tokens 262144 --cases "
                  "msa_sparse_loss --no-attention-rows --no-pair-rate --grow-to 1048576 --steps 2 "
                  "--warmup 1 --json {out}/long.json >> {out}/long.log"],
    "bench": ["timeout -k 30 300 {py} benchmarks/bench_msa.py --sizes 131072 --packed 0 >> "
              "{out}/bench.log"],
    "ab": ["# when {root}/.base/benchmarks/bench_msa.py exists:", "cd {root}/.base && PYTHONPATH="
           "{root}/.base NEMO_MSA_COMMIT='tree {root}/.base' timeout -k 30 200 {py} benchmarks/"
           "bench_msa.py --sizes 8192,32768 --packed 32768 --no-dense", "timeout -k 30 200 {py} "
           "benchmarks/bench_msa.py --sizes 8192,32768"],
    "peer": ["{py} benchmarks/bench_flash_msa_peer.py --site /tmp/fm_site --site {site} "
             "--budget-s 430 --json {out}/peer.json"],
    "fla_peer": ["{py} benchmarks/bench_fla_nsa_peer.py --site {site} --budget-s 480 --json "
                 "{out}/fla_peer.json"],
    "peer_part": ["# copy {root}/.peers/part*/* to /tmp/peer_parts/"],
    "sparse_peers": [
        "# when /tmp/peer_site/.installed is missing and /tmp/peer_parts/cu13.tar.xz.sha256 has "
        "come:", "{py} -m pip install -q --no-index --no-deps --no-compile --target "
        "/tmp/peer_site", "# join /tmp/peer_parts/cu13.tar.xz.part* into /tmp/peer_parts/"
        "cu13.tar.xz", "cd /tmp/peer_parts && sha256sum -c cu13.tar.xz.sha256",
        "# extract /tmp/peer_parts/cu13.tar.xz into /tmp/peer_site",
        "# mark /tmp/peer_site/.installed", "timeout -k 30 500 {py} benchmarks/"
        "bench_sparse_peers.py --site /tmp/peer_site --budget-s 440 --json "
        "{out}/sparse_peers.json >> {out}/sparse_peers.log"],
    "pretrain": ["timeout -k 30 240 {py} scripts/pretrain.py model.bf16=true", "train.train_iters"
                 "=300 logger.output_dir={out}/pretrain >> {out}/pretrain.log"],
    "determinism": ["timeout -k 30 540 {py} benchmarks/determinism_check.py --out "
                    "{out}/determinism --steps 40 --interrupt-at 20 -- >> {out}/determinism.log"],
    "pp1": ["timeout -k 30 90 {py} scripts/pretrain.py --recipe recipes/msa_pp2_vpp2_tp2.yaml",
            "# copy metrics.jsonl and loss_curve.png from /tmp/pp1_checkpoints"],
    "quality_runs": ["# when /tmp/corpus_qr/args does not hold the corpus options:",
                     "{py} scripts/prepare_corpus.py --out /tmp/corpus_qr --copy-fraction 0.05",
                     "--arms dense --time-budget-s 420", "--arms control", "--arms msa", "wait",
                     "--arms dense,control,msa --probes passkey,mqar --steps 2000 --seq-lengths "
                     "8192 train.eval_interval=250 --finished", "# when every arm has its steps",
                     "--time-budget-s 60", "# copy quality.md"],
}


def _printed(capsys, *argv: str) -> list[str]:
    assert cli.main(list(argv)) == 0
    captured = capsys.readouterr()
    assert not captured.err, captured.err
    return captured.out.splitlines()


def _in_order(lines: list[str], expected: list[str]) -> None:
    """Each of ``expected`` is in a line of ``lines``, the same as the last one's or a later."""
    at = 0
    for part in expected:
        found = [i for i, line in enumerate(lines) if i >= at and part in line]
        assert found, f"{part!r} not printed from line {at} on:\n" + "\n".join(lines)
        at = found[0]


@pytest.mark.parametrize("name", NAMES, ids=[f"stage_{name}" for name in NAMES])
def test_a_dry_run_prints_the_stages_commands_and_writes_nothing(capsys, tmp_path, name):
    out, site = tmp_path / "out", tmp_path / "site"
    # A site folder that does not exist, so that no earlier install on this machine changes
    # the commands' PYTHONPATH.
    lines = _printed(capsys, name, "--dry-run", "--out", str(out), "--wheels", str(tmp_path),
                     "--site", str(site))
    assert lines[0] == f"# python -m benchmarks.device {name} --dry-run --out {out} --wheels " \
                       f"{tmp_path} --site {site}"
    assert lines[-1].startswith(f"# then writes {out}/{name}.run.json")
    fill = dict(py=sys.executable, root=runner.ROOT, out=out, site=site)
    _in_order(lines, [part.format(**fill) for part in DRY_RUNS[name]])
    for line in lines:  # every command is one the shell runs as printed
        if not line.startswith("#") and line != "wait":
            shlex.split(line.removesuffix(" &"))
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_dry_run_shows_the_wheels_install_and_the_options_given(capsys, tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "pkg-1.0-py3-none-any.whl").write_bytes(b"")
    lines = _printed(capsys, "rows", "--dry-run", "--wheels", str(tmp_path / "w"), "--site",
                     str(tmp_path / "site"), "--out", str(tmp_path / "out"), "--tokens", "64",
                     "--seconds", "5", "--args", "--tiny --cpu")
    assert lines[1] == f"# every command's environment: PYTHONUNBUFFERED=1 PYTHONPATH=" \
                       f"{tmp_path / 'site'}:{runner.ROOT}"
    assert lines[2] == (f"{sys.executable} -m pip install -q --no-index --no-deps --no-compile "
                        f"--no-cache-dir --upgrade --target {tmp_path / 'site'} "
                        f"{tmp_path / 'w' / 'pkg-1.0-py3-none-any.whl'}")
    assert "timeout -k 30 5 " in lines[3] and "--tokens 64 " in lines[3]
    assert lines[3].split(" >> ")[0].endswith("rows_fresh.json --tiny --cpu")
    assert not (tmp_path / "site").exists() and not (tmp_path / "out").exists()


def test_a_bound_stops_a_command_as_timeout_did(tmp_path, monkeypatch):
    ctx = runner.Context(tmp_path, {"PATH": "/usr/bin:/bin"})
    log = tmp_path / "log"
    assert ctx.run(runner.python("-c", "import time; print('up', flush=True); time.sleep(60)",
                                 log=log, seconds=1.0)) == 124
    assert log.read_text() == "up\n"
    # A command that ignores the bound's signal is killed KILL_AFTER_S later: 137.
    monkeypatch.setattr(runner, "KILL_AFTER_S", 0.5)
    ignores = ("import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
               "print('up', flush=True); time.sleep(60)")
    assert ctx.run(runner.python("-c", ignores, log=log, seconds=1.0, interrupt=True)) == 137
    assert [step["rc"] for step in ctx.steps] == [124, 137]
    assert all(step["seconds"] < 30 for step in ctx.steps), ctx.steps


def test_a_run_records_the_command_commit_card_and_date(tmp_path, capsys):
    # The real probe: a child process that imports torch (for the card) and the package.
    (tmp_path / "parts" / "part0").mkdir(parents=True)
    (tmp_path / "parts" / "part0" / "core.whl.part00").write_bytes(b"x" * 7)
    out, dest = tmp_path / "out", tmp_path / "te"
    argv = ["te_part", "--out", str(out), "--parts", str(tmp_path / "parts"), "--dest", str(dest),
            "--commit", "0123abc", "--wheels", str(tmp_path / "none")]
    assert cli.main(argv) == 0
    assert (dest / "core.whl.part00").read_bytes() == b"x" * 7
    record = json.loads((out / "te_part.run.json").read_text())
    assert record["command"] == "python -m benchmarks.device " + shlex.join(argv)
    assert record["commit"] == "0123abc"
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA)"
    assert record["card"] == card and record["torch"] == torch.__version__
    assert record["date"].endswith("Z") and record["finished"] >= record["date"]
    assert record["summary"]["held"] == {"core.whl.part00": 7}
    assert record["options"]["dest"] == str(dest) and record["failed_commands"] == 0


def test_a_missing_base_tree_fails_the_ab_stage_by_name(tmp_path, monkeypatch, capsys):
    assert run_stage(monkeypatch, "ab", "--out", tmp_path, "--base", tmp_path / "nope") == 1
    assert f"ab: --base {tmp_path / 'nope'}: no {tmp_path / 'nope'}/benchmarks/bench_msa.py" \
        in capsys.readouterr().err
    record = json.loads((tmp_path / "ab.run.json").read_text())
    assert record["commit"] == "abc1234" and "no " in record["summary"]["error"]
