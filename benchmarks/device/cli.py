"""``python -m benchmarks.device <stage> [options]``: the parser, the wheels' install, the run
record and the stage's run."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from . import options
from .record import probe_environment, utc_now, write_record
from .runner import ROOT, Context, StageError, python
from .stages import STAGES

PROG = "python -m benchmarks.device"


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The stage's docstring as written, and each option's default where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default in ("", []):
            return action.help
        return super()._get_help_string(action)


def _common() -> argparse.ArgumentParser:
    """The options every stage takes."""
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("every stage")
    group.add_argument("--out", type=options.path, default=os.environ.get("OUT", "runs/device"),
                       help="output folder: the stage's logs, JSON and <stage>.run.json (the "
                            "default is the device machine's $OUT where set)")
    group.add_argument("--wheels", type=options.path, default=".whl",
                       help="wheels (megatron-core, omegaconf, ...) installed with pip --target "
                            "into --site first, where the folder holds any")
    group.add_argument("--site", type=options.path, default="/tmp/site",
                       help="the wheels' install folder, first on every command's PYTHONPATH")
    group.add_argument("--commit", default=None,
                       help="the commit to record and to give the commands (NEMO_MSA_COMMIT); "
                            "default: NEMO_MSA_COMMIT, else git, else the tree's .commit file")
    group.add_argument("--dry-run", action="store_true",
                       help="print the commands the stage would run; run and write nothing")
    return common


def build_parser() -> argparse.ArgumentParser:
    """The entry's parser: one subcommand per stage, each with its options and the common ones."""
    listing = "\n".join(f"  {stage.NAME:<13} {stage.HELP}" for stage in STAGES)
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The GPU checks and measurements, one stage per call, run from the "
                    "repository root\non a device machine. Each stage writes its logs, its JSON "
                    "and <stage>.run.json\n(the command line, commit, card and date) to --out.",
        epilog=f"stages:\n{listing}\n\n'{PROG} <stage> --help' gives a stage's options and "
               "what it writes;\n'--dry-run' prints the commands it would run.")
    stages = parser.add_subparsers(dest="stage", metavar="<stage>", required=True,
                                   help="one of the stages below")
    common = _common()
    for stage in STAGES:
        # No help= here: the epilog lists the stages, one line each.
        sub = stages.add_parser(stage.NAME, description=stage.__doc__, parents=[common],
                                formatter_class=_Formatter)
        stage.add_arguments(sub.add_argument_group(f"{stage.NAME} options"))
        sub.set_defaults(module=stage)
    return parser


def _environment(args: argparse.Namespace, site: Path | None) -> dict[str, str]:
    """Every command's environment: this one, Python unbuffered (logs in order), the wheels'
    ``site`` (where not None) and this tree on PYTHONPATH, the commit where given."""
    path = ([str(site)] if site is not None else []) + [str(ROOT)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(path)}
    if args.commit:
        env["NEMO_MSA_COMMIT"] = args.commit
    return env


def _install_wheels(args: argparse.Namespace, wheels: list[Path], ctx: Context) -> int:
    """Installs the carried wheels into ``--site`` (no index, no dependencies: the folder holds
    each one the stages need); pip's exit status."""
    return ctx.run(python("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--no-cache-dir", "--upgrade", "--target", args.site, *wheels))


def main(argv: list[str] | None = None) -> int:
    """Runs (or with ``--dry-run`` prints) one stage; 0 where every command it ran exited 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    stage = args.module
    command_line = f"{PROG} {shlex.join(argv)}"
    wheels = sorted(args.wheels.glob("*.whl")) if args.wheels.is_dir() else []
    site = args.site if wheels or args.site.is_dir() else None
    ctx = Context(args.out, _environment(args, site), dry=args.dry_run, site=site)
    record_path = args.out / f"{stage.NAME}.run.json"
    if ctx.dry:
        print(f"# {command_line}\n# every command's environment: PYTHONUNBUFFERED=1 "
              f"PYTHONPATH={ctx.env['PYTHONPATH']}", flush=True)
    if wheels and _install_wheels(args, wheels, ctx):
        print(f"{stage.NAME}: installing {args.wheels}/*.whl into {args.site} failed",
              file=sys.stderr)
        return 1
    record = {}
    if not ctx.dry:
        record = {"stage": stage.NAME, "command": command_line, "date": utc_now(),
                  **probe_environment(ctx.env), "finished": None,
                  "options": {k: v for k, v in vars(args).items() if k not in ("module", "stage")},
                  "steps": ctx.steps}
        if not record["commit"].startswith("unknown"):  # the commands name the same commit
            ctx.env.setdefault("NEMO_MSA_COMMIT", record["commit"])
        write_record(record_path, record)
    try:
        summary = stage.run(args, ctx)
    except StageError as e:
        print(f"{stage.NAME}: {e}", file=sys.stderr, flush=True)
        summary = {"error": str(e)}
    if ctx.dry:
        print(f"# then writes {record_path} (command, commit, card, date, each command's status)")
        return 0
    failed = [step for step in ctx.steps if step["rc"] != 0 and not step["question"]]
    record.update(finished=utc_now(), summary=summary, failed_commands=len(failed))
    write_record(record_path, record)
    print(f"{stage.NAME}: {len(ctx.steps)} commands, {len(failed)} with a non-zero status; "
          f"record {record_path}", flush=True)
    return 1 if failed or "error" in (summary or {}) else 0
