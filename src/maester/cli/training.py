"""The commands of a run: train, seed a checkpoint, submit and sweep on SLURM, launch locally, show the config,
check the collectives, the μP coordinate check. Each is an `add_*` (its arguments) and a `run_*` (what it does,
importing torch only there)."""

from __future__ import annotations

import os
import sys

from maester import exit_codes

OVERRIDES_HELP = "then any number of config overrides: --section.key=value or --section.key value"


def add_train(sub, name: str) -> None:
    p = sub.add_parser(name, help="train from a config file or a job directory (resumes automatically)",
                       epilog=f"{OVERRIDES_HELP}. Exit codes: 0 trained to training.steps (or already had: the "
                              f"job's COMPLETED marker covers them); {exit_codes.BAD_INPUT} a config or input error; "
                              f"{exit_codes.REQUEUE} stopped on SIGTERM, SIGUSR1 or <job>/stop-requested after saving "
                              f"a checkpoint (<job>/requeue-requested written): run it again to resume; "
                              f"{exit_codes.NONFINITE} a non-finite loss or gradient; {exit_codes.OUT_OF_MEMORY} out "
                              f"of device memory; {exit_codes.COLLECTIVE} a collective failed or timed out.")
    p.add_argument("target", help="a config file (TOML/YAML/JSON) or a job directory jobs/<name>")


def run_train(args) -> None:
    from maester.jobs.job_dir import config_for_target, is_job_dir, lock_job_dir, refuse_checkpoint, write_job_dir
    from maester.train.preemption import COMPLETED_FILE, REQUEUE_FILE, completed_marker

    refuse_checkpoint(args.target, "train")
    rank = int(os.environ.get("RANK", "0"))
    # A job whose COMPLETED marker covers training.steps (a later link of a chain) has nothing to do: it exits
    # before torch is imported and leaves the job directory as it is.
    cfg, job_dir = config_for_target(args.target, args.overrides)
    done = completed_marker(job_dir, cfg.training.steps)
    if done is not None:
        if rank == 0:
            print(f"{job_dir / COMPLETED_FILE}: training completed at step {done['step']} (training.steps = "
                  f"{cfg.training.steps}): nothing to do", file=sys.stderr)
        return

    import torch.distributed as dist

    from maester.train.setup import setup_logging
    from maester.train.trainer import Trainer

    setup_logging(None, rank)  # so that write_job_dir reports what the overrides change
    lock, existing = None, is_job_dir(job_dir)
    created = next((d for d in reversed([job_dir, *job_dir.parents]) if not d.exists()), None)  # the top one
    if rank == 0:
        lock = lock_job_dir(job_dir, cfg.training.requeue_lock_wait_seconds)
        if not existing:
            write_job_dir(cfg, job_dir)
    try:
        try:
            trainer = Trainer(cfg, job_dir)
        except BaseException:
            if rank == 0 and created is not None:  # a run refused before its first step leaves no directory
                _remove_new_job_dir(created, job_dir, lock)
                lock = None
            raise
        if rank == 0 and existing:  # an override that fails the resume is not kept in config.json
            write_job_dir(cfg, job_dir)
        result = trainer.train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if lock is not None:
            lock.release()
    if result.stop_reason is not None:
        if rank == 0:
            print(f"stopped on request ({result.stop_reason}) at step {result.step}; checkpoint {result.checkpoint}; "
                  f"wrote {job_dir / REQUEUE_FILE}; exiting with code {exit_codes.REQUEUE} for a requeue")
        sys.exit(exit_codes.REQUEUE)
    if rank == 0:
        print(f"trained to step {result.step}; job directory {job_dir}"
              + (f"; checkpoint {result.checkpoint}" if result.checkpoint else ""))


def _remove_new_job_dir(created, job_dir, lock) -> None:
    """Remove what this run created (`created`: the job directory or the first of its parents that did not exist),
    closing the job's log files and lock first."""
    import logging
    import shutil

    root = logging.getLogger("maester")
    for handler in [h for h in root.handlers if str(getattr(h, "baseFilename", "")).startswith(str(job_dir.resolve()))]:
        root.removeHandler(handler)
        handler.close()
    if lock is not None:
        lock.release()
    shutil.rmtree(created, ignore_errors=True)


def add_seed_checkpoint(sub, name: str) -> None:
    p = sub.add_parser(name, epilog=OVERRIDES_HELP,
                       help="initialise the model on one process and save it as the job's step-0 checkpoint")
    p.add_argument("target", help="a config file or a job directory")


def run_seed_checkpoint(args) -> None:
    from maester.jobs.job_dir import config_for_target, locked_for_writing, refuse_checkpoint, write_job_dir
    from maester.train.checkpoint_dirs import check_seedable
    from maester.train.trainer import write_seed_checkpoint

    refuse_checkpoint(args.target, "seed-checkpoint")
    cfg, job_dir = config_for_target(args.target, args.overrides)
    with locked_for_writing(job_dir, "seed-checkpoint"):
        check_seedable(job_dir)
        write_job_dir(cfg, job_dir)
        print(f"seed checkpoint {write_seed_checkpoint(cfg, job_dir)}")


def add_submit(sub, name: str) -> None:
    p = sub.add_parser(name, help="create the job directory jobs/<name> for a config and sbatch its slurm.sh",
                       epilog=OVERRIDES_HELP)
    p.add_argument("config", help="a config file (TOML/YAML/JSON)")
    p.add_argument("--name", help="job name (default: job.name from the config)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and the script, write nothing")
    p.add_argument("--no-submit", action="store_true", help="write the job directory, do not call sbatch")
    p.add_argument("--chain", type=int, default=1, metavar="K",
                   help="submit K jobs, each starting when the previous ends (afterany): runs longer than the walltime")
    p.add_argument("--after", metavar="JOBID", help="the first job waits for this SLURM job to end")
    p.add_argument("--force", action="store_true",
                   help="submit even when the plan made first predicts the job runs out of GPU memory")
    p.add_argument("--update-config", action="store_true",
                   help="the job exists and this config changes it: replace its config.json all the same (the "
                        "changes are listed; a job with a checkpoint keeps its model), as `maester train CONFIG` does")
    p.add_argument("--then", action="append", default=[], metavar="COMMAND",
                   help="a post-processing command, run once in a job of its own when training completes (adds to "
                        "slurm.after; repeat for more), e.g. --then 'maester convert to-hf \"$JOB_DIR\" out/hf'")


def run_submit(args) -> None:
    from maester.cli.plan import plan_before_submit
    from maester.config import load_config
    from maester.jobs.job_dir import config_changes, locked_for_writing, write_job_dir
    from maester.jobs.slurm import SubmitError, check_inputs, render_slurm_script, submit_job
    from maester.plan.record import write_plan

    overrides = list(args.overrides) + ([f"--job.name={args.name}"] if args.name else [])
    cfg = load_config(args.config, overrides)
    if args.then:
        import json

        cfg = load_config(args.config, overrides + [f"--slurm.after={json.dumps(cfg.slurm.after + args.then)}"])
    if args.dry_run:
        print(cfg.to_json(), end="")
        print(f"# dry run: would write {cfg.job_dir}/config.json, slurm.sh, logs/, checkpoints/", file=sys.stderr)
        print(render_slurm_script(cfg, cfg.job_dir), end="", file=sys.stderr)
        return
    if args.chain < 1:
        raise SubmitError(f"--chain {args.chain}: must be at least 1")
    render_slurm_script(cfg, cfg.job_dir)  # template errors before anything is written
    problems = check_inputs(cfg)
    if problems:
        raise SubmitError("the job would fail on the cluster:\n  " + "\n  ".join(problems))
    with locked_for_writing(cfg.job_dir, "submit"):
        changes = config_changes(cfg, cfg.job_dir, args.update_config)
        plan = plan_before_submit(cfg, force=args.force)  # a GPU job predicted to run out of memory stops here
        if changes:
            print(f"updating {cfg.job_dir / 'config.json'}: {', '.join(changes)}", file=sys.stderr)
        job_dir = write_job_dir(cfg)
        if plan is not None:
            write_plan(job_dir, plan)
    if args.no_submit:
        print(f"job directory {job_dir}: run with `maester train {job_dir}`, `maester launch {job_dir}` or "
              f"`sbatch {job_dir}/slurm.sh`")
        return
    ids = submit_job(job_dir, chain=args.chain, after=args.after)
    print(f"job directory {job_dir}: submitted SLURM job{'s' if len(ids) > 1 else ''} {' -> '.join(ids)}")


def add_sweep(sub, name: str) -> None:
    p = sub.add_parser(name, help="a grid of jobs: submit, status, cancel, retry, report")
    ssub = p.add_subparsers(dest="sweep_command", required=True, metavar="ACTION")
    q = ssub.add_parser("submit", help="one job directory per point under <dump_dir>/<sweep name>/, each submitted",
                        epilog=OVERRIDES_HELP)
    q.add_argument("sweep", help="a sweep file (TOML/YAML/JSON): name, base, mode, fixed, parameters")
    q.add_argument("--no-submit", action="store_true", help="write the job directories, do not call sbatch")
    for action, text in (("status", "a table: job, SLURM state, last step, last loss"),
                         ("cancel", "scancel the points still queued or running"),
                         ("retry", "submit again the points that failed or were cancelled"),
                         ("run", "train the points not yet completed here, one after another, without SLURM"),
                         ("report", "write report.csv and report.png in the sweep directory")):
        q = ssub.add_parser(action, help=text)
        q.add_argument("dir", help="the sweep directory (<dump_dir>/<sweep name>)")
    q.add_argument("--transfer", action="store_true",
                   help="also transfer.png: final loss against LR, a line per width (μP LR transfer)")
    q.add_argument("--lr-key", default="optimizer.lr", help="the LR parameter for --transfer (default optimizer.lr)")
    q.add_argument("--width-key", default="model.width",
                   help="the width parameter for --transfer (default model.width)")


def run_sweep(args) -> None:
    from pathlib import Path

    from maester.jobs import sweep

    if args.sweep_command == "submit":
        root = sweep.submit_sweep(Path(args.sweep), list(args.overrides), no_submit=args.no_submit)
        points = sweep.load_sweep(root)["points"]
        print(f"sweep {root}: {len(points)} points {'written' if args.no_submit else 'submitted'}")
        return
    if args.overrides:
        raise ValueError(f"maester sweep {args.sweep_command} takes no overrides: {' '.join(args.overrides)}")
    root = Path(args.dir)
    if args.sweep_command == "status":
        print(sweep.format_status(sweep.status(root)))
    elif args.sweep_command == "cancel":
        ids = sweep.cancel(root)
        print(f"cancelled {' '.join(ids)}" if ids else "nothing queued or running")
    elif args.sweep_command == "retry":
        names = sweep.retry(root)
        print(f"resubmitted {' '.join(names)}" if names else "no failed or cancelled points")
    elif args.sweep_command == "run":
        names = sweep.run_here(root)
        print(f"trained {' '.join(names)}" if names else "every point has completed")
    else:
        csv_path, png_path = sweep.report(root)
        print(f"{csv_path}\n{png_path}")
        if args.transfer:
            path, best = sweep.transfer_plot(root, sweep.status(root), args.lr_key, args.width_key)
            print(path)
            for panel, lrs in best.items():
                print(f"{panel}: best {args.lr_key} per width: "
                      + ", ".join(f"{w}: {lr:.3g}" for w, lr in sorted(lrs.items())))


def add_launch(sub, name: str) -> None:
    p = sub.add_parser(name, help="run a job directory here under torchrun, logging as a SLURM job would")
    p.add_argument("job", help="a job directory")
    p.add_argument("--nproc", type=int, default=1, help="processes (default 1)")


def run_launch(args) -> None:
    from pathlib import Path

    from maester.jobs.launch import launch_local

    sys.exit(launch_local(Path(args.job), args.nproc))


def add_config(sub, name: str) -> None:
    p = sub.add_parser(name, help="inspect configs")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = csub.add_parser("show", help="print the resolved config tree", epilog=OVERRIDES_HELP)
    show.add_argument("config", help="a config file or a job directory")
    show.add_argument("--format", choices=("json", "yaml"), default="json")


def run_config(args) -> None:
    from maester.jobs.job_dir import config_for_target

    cfg, _ = config_for_target(args.config, args.overrides)
    if args.format == "yaml":
        import yaml

        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    else:
        print(cfg.to_json(), end="")


def add_preflight(sub, name: str) -> None:
    p = sub.add_parser(name, epilog=OVERRIDES_HELP,
                       help="check all-reduce, all-gather and reduce-scatter results and bandwidth on the job's "
                            "processes (run it under torchrun or srun as the job runs); writes <job>/preflight.json")
    p.add_argument("target", help="a job directory or a config file")
    p.add_argument("--fail-fast", action="store_true",
                   help="stop at the first wrong result and exit with status 1 (a timeout always does); the "
                        "config's preflight.fail_fast applies to the check before training")
    p.add_argument("--sizes", nargs="+", metavar="SIZE",
                   help="buffer sizes in bytes, e.g. 4096 64K 32MiB 1G (default: preflight.sizes)")
    p.add_argument("--dtypes", nargs="+", metavar="DTYPE", choices=("float32", "bfloat16", "float16"),
                   help="float32, bfloat16, float16 (default: preflight.dtypes)")


def run_preflight(args) -> None:
    import json

    import torch.distributed as dist

    from maester.jobs.job_dir import config_for_target, refuse_checkpoint
    from maester.files import parse_buffer_size
    from maester.parallel.preflight import PreflightFailed, run_preflight
    from maester.parallel.dims import init_distributed

    overrides = list(args.overrides)
    if args.sizes:
        overrides.append(f"--preflight.sizes={json.dumps([parse_buffer_size(s) for s in args.sizes])}")
    if args.dtypes:
        overrides.append(f"--preflight.dtypes={json.dumps(args.dtypes)}")
    refuse_checkpoint(args.target, "preflight")
    cfg, job_dir = config_for_target(args.target, overrides)
    rank, _, device = init_distributed(cfg.training.device, precision=cfg.training.precision)
    try:
        report = run_preflight(cfg.preflight, job_dir, device, fail_fast=args.fail_fast)
    except PreflightFailed as e:
        if rank == 0:
            print(f"maester preflight: {e}", file=sys.stderr)
        sys.exit(exit_codes.CHECK_FAILED)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if not report.ok and rank == 0:
        print("maester preflight: some collectives gave WRONG results (see the table); without --fail-fast the "
              "status is 0", file=sys.stderr)


def add_mup(sub, name: str) -> None:
    p = sub.add_parser(name, help="μP tools: the coordinate check")
    msub = p.add_subparsers(dest="mup_command", required=True, metavar="ACTION")
    q = msub.add_parser("coord-check", epilog=OVERRIDES_HELP,
                        help="train the config's model at several widths a few steps on one batch and plot the "
                             "mean |activation| of embedding, attention, MLP and logits against width")
    q.add_argument("config", help="a config file (its model, optimizer, mup and data sections are used)")
    q.add_argument("--widths", required=True, help="comma-separated model widths, e.g. 64,128,256,512,1024")
    q.add_argument("--steps", type=int, default=3, help="training steps per width (default 3)")
    q.add_argument("--seeds", type=int, default=1, help="seeds per width, averaged (default 1)")
    q.add_argument("--out", help="output directory (default <job dir>/coord-check-mup or -sp)")


def run_mup(args) -> None:
    from pathlib import Path

    from maester.config import load_config
    from maester.tools.coord_check import run
    from maester.train.setup import setup_logging

    setup_logging()
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        raise ValueError(f"--widths {args.widths!r}: give comma-separated integers, e.g. 64,128,256") from None
    cfg = load_config(args.config, args.overrides)
    out = Path(args.out) if args.out else cfg.job_dir / ("coord-check-mup" if cfg.mup.enabled else "coord-check-sp")
    csv_path, png_path, spread = run(cfg, widths, args.steps, args.seeds, out)
    print(f"wrote {csv_path} and {png_path}")
    print(f"largest / smallest mean |activation| across widths {widths[0]}..{widths[-1]} at step {args.steps}: "
          + ", ".join(f"{k} {v:.2f}x" for k, v in spread.items()))
