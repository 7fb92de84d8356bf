"""The Kubernetes Job's command: the whole chain, from nothing to a registered adapter.

    python -m orthojob.job --preset qwen2.5-3b --steps 300 --task-id task_easy \
        --out-base s3://orthorl/runs [--run-name NAME] [--from-checkpoint URI]

What runs (each step through the ``orthojob`` CLI, in this process):

1. without ``--from-checkpoint``: ``orthojob pipeline --preset P --out OUT`` (tiny model when the
   preset says so, the preset's SFT stages (by default BC SFT, stage 2) and their gates, GRPO,
   GRPO's gate, evaluation), with ``--set grpo.steps=N --set task_id=T [--set model=M]``; the GRPO
   run's id comes from the pipeline's summary. With ``--from-checkpoint`` (an already gated SFT
   checkpoint): ``orthojob grpo --from-checkpoint URI --out OUT/grpo`` (its pre-flight checks the
   gate file; its own GRPO gate runs at the end);
2. when the chain passed its gates (exit 0): ``orthojob promote --run-id RUN``: the adapter is
   registered, alias ``candidate`` (``champion`` only when it beats the current one). Under a
   launcher with several ranks (the multi-node TrainJob: ``accelerate launch --module
   orthojob.job``) every rank trains, and rank 0 (``RANK``) alone promotes.

OUT, the output prefix, is per Job: ``--out`` if given, else ``<--out-base>/<--run-name>``, and the
run name defaults to ``<K8S_JOB_NAME>-<first 8 characters of K8S_JOB_UID>`` (both injected by
the Job through the downward API). A pod retried by the same Job gets the same prefix and resumes
its checkpoints; a new Job (re-applied, or submitted again) never shares one. Set ``--run-name``
(the ConfigMap's ``RUN_NAME``) to continue a named run on purpose.

Agentic GRPO (``--mode agentic``; k8s/agentic/): the GRPO stage runs ``--mode agentic``, with
``--env-url URL`` its tools on the environment server at URL (``python -m server.app``) instead of
in process: ``--mode agentic --env-url URL`` on ``grpo``, ``--set grpo.mode=agentic --set
grpo.env_url=URL`` on ``pipeline``. The other stages do not use the server.

Base weights (``--model``, the ConfigMap's ``MODEL``): a hub id, an ``s3://bucket/prefix`` staged
with ``orthojob model stage``, or a folder on a mounted volume; every stage fetches an ``s3://``
base once into the model cache (``ORTHORL_MODEL_CACHE``, on the pod's persistent ``/cache``), and
adapters record the URI as their base (:mod:`orthojob.modeling.base_models`).

Pre-flight, before anything is downloaded or trained (:func:`preflight`):

* the output prefix is required (``--out`` or ``--out-base``; the ConfigMap's ``OUTPUT_URI`` has no
  default: a bucket of someone else's is no default) and probed: a marker is written, read back and
  deleted there. Bad keys, no permission or no such bucket end the job at once with exit 32 (never
  retried) and what to fix; an endpoint that stays unreachable is exit 30 (retried);
* MLflow is probed (:func:`orthojob.ops.tracking.configure`): unreachable is exit 31 (retried), a
  refusal (credentials, permission) exit 33; under ``MLFLOW_RUN_ID`` (MLflow Projects) that run must
  exist on this server: MLflow's Kubernetes backend creates it in the *workstation's* tracking store,
  so a workstation pointed elsewhere than the pods ends here with exit 33 and the fix;
* a model that is not the offline tiny one needs a GPU; without CUDA the job refuses (exit 2) rather
  than "training" a 3B model on CPU for days (``ORTHORL_ALLOW_CPU=1`` overrides).

Exit code: the first failing step's, from :class:`orthojob.ops.exit_codes.ExitCode`: 3 when GRPO's
gate failed (nothing is registered), 30/31 when storage/MLflow stayed unreachable, 32/33 when they
refused, 20-22 when the registry refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from orthojob.cli import main as cli_main
from orthojob.lifecycle.registry import DEFAULT_MODEL_NAME
from orthojob.ops import storage, tracking
from orthojob.ops.exit_codes import ExitCode
from orthojob.ops.job_errors import report_job_error
from orthojob.ops.preemption import install_termination_handler
from orthojob.ops.storage import StorageError
from orthojob.ops.tracking import TrackingError
from orthojob.ops.work_dirs import local_work_dir

TINY_PRESETS = ("tiny-cpu",)
MODES = ("oneshot", "agentic")
"""GRPO's modes (:data:`orthojob.stages.grpo_config.MODES`, which this module does not import: it is the
container's command and stays light; a test keeps the two equal)."""
ALLOW_CPU_ENV = "ORTHORL_ALLOW_CPU"


def run_name(env: Mapping[str, str]) -> str:
    """``<job name>-<uid[:8]>`` from the downward-API variables; a local fallback outside a Job."""
    job = (env.get("K8S_JOB_NAME") or "").strip()
    uid = (env.get("K8S_JOB_UID") or "").strip()
    if job and uid:
        return f"{job}-{uid[:8]}"
    if job:
        return job
    from datetime import UTC, datetime

    return f"local-{datetime.now(UTC):%Y%m%d-%H%M%S}-{os.getpid()}"


UNSET = ("", "none", "''", '""')
"""Values meaning "not set": MLflow's Kubernetes backend re-quotes every token of a command that
runs without a shell, so an empty parameter arrives as the two characters '' (hence the
mlflow-k8s project's default ``none``)."""


def _given(value: str | None) -> str:
    value = (value or "").strip()
    return "" if value.lower() in UNSET else value


def output_prefix(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    """The run's output prefix (module docstring)."""
    if _given(args.out):
        return _given(args.out).rstrip("/")
    base = _given(args.out_base).rstrip("/")
    if not base:
        raise ValueError(
            "the output prefix is required: pass --out URI, or --out-base URI (the ConfigMap's OUTPUT_URI, "
            "e.g. s3://YOUR-BUCKET/orthorl/runs, set in k8s/kustomization.yaml)"
        )
    return f"{base}/{_given(args.run_name) or run_name(env)}"


@dataclass
class Plan:
    out: str
    chain: list[str]  # the first command's argv (orthojob ...)
    register: bool
    model_name: str
    notes: list[str] = field(default_factory=list)


def plan(args: argparse.Namespace, env: Mapping[str, str]) -> Plan:
    """What the job will run, without running anything (tests assert it)."""
    if _given(args.vllm_server_url) and not _given(args.from_checkpoint):
        # the full chain (pipeline) has no server mode: it would drop the server and its timeout
        raise ValueError(
            f"--vllm-server-url {_given(args.vllm_server_url)} needs --from-checkpoint: GRPO on a vLLM server "
            "starts from a gated SFT checkpoint. Set CHECKPOINT_URI (the ConfigMap orthorl-multinode-config, "
            "k8s/multinode/vllm.yaml) to one, e.g. OUTPUT_URI/<job name>-<uid[:8]>/bc_sft of a single-node run"
        )
    out = output_prefix(args, env)
    env_url = _given(args.env_url)
    if env_url and args.mode != "agentic":
        raise ValueError(f"--env-url {env_url} needs --mode agentic (the tools it serves are agentic mode's)")
    checkpoint = _given(args.from_checkpoint)
    notes = []
    if checkpoint and _given(args.stages):  # the agentic component sets STAGES for its whole chain
        notes.append(f"--stages {_given(args.stages)} ignored: --from-checkpoint starts at GRPO")
    if checkpoint:
        chain = ["grpo", "--preset", args.preset, "--steps", str(args.steps), "--task-id", args.task_id]
        chain += ["--from-checkpoint", checkpoint, "--out", f"{out}/grpo"]
        if _given(args.model):
            chain += ["--model", args.model]
        if args.use_vllm or _given(args.vllm_server_url):
            chain.append("--use-vllm")
        if _given(args.vllm_server_url):  # a vLLM server (the multi-node TrainJob's orthorl-vllm)
            chain += ["--vllm-mode", "server", "--vllm-server-url", _given(args.vllm_server_url)]
            chain += ["--vllm-server-timeout", str(args.vllm_server_timeout)]
        if args.mode != "oneshot":
            chain += ["--mode", args.mode]
        if env_url:
            chain += ["--env-url", env_url]
    else:
        chain = ["pipeline", "--preset", args.preset, "--out", out]
        chain += ["--set", f"grpo.steps={int(args.steps)}", "--set", f"task_id={args.task_id}"]
        if _given(args.model):
            chain += ["--set", f"model={args.model}"]
        if _given(args.stages):
            chain += ["--set", f"stages={_given(args.stages)}"]
        if args.mode != "oneshot":  # before env_url: each --set is checked as it is applied
            chain += ["--set", f"grpo.mode={args.mode}"]
        if env_url:
            chain += ["--set", f"grpo.env_url={env_url}"]
    return Plan(out, chain, not args.no_register, args.model_name, notes)


def needs_gpu(args: argparse.Namespace) -> bool:
    return args.preset not in TINY_PRESETS or bool(_given(args.model) and args.model != "tiny")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def grpo_run_id(p: Plan) -> str | None:
    """The GRPO stage's MLflow run: from the pipeline's summary, or the last run of ``grpo``."""
    if p.chain[0] == "pipeline":
        local = local_work_dir(p.out) if storage.is_s3_uri(p.out) else Path(p.out)
        summary = local / "pipeline_summary.json"
        if summary.is_file():
            return json.loads(summary.read_text()).get("stages", {}).get("grpo", {}).get("mlflow_run_id")
        return None
    return tracking.last_stage_run("grpo")


def preflight(p: Plan, env: Mapping[str, str], say: Callable[[str], object] = print) -> int:
    """Probe the output prefix and MLflow (module docstring); 0, or the exit code (message printed)."""
    try:
        say(f"[job] probe: {storage.probe_output(p.out)}")
        experiment_id = tracking.configure()
        say(f"[job] probe: MLflow at {tracking.redact(tracking.tracking_uri())} answers")
        if tracking.tracking_uri().startswith(("http://", "https://")):
            say(f"[job] probe: {tracking.probe_artifacts(experiment_id)}")
        run_id = _given(env.get("MLFLOW_RUN_ID"))
        if run_id:
            import mlflow
            from mlflow.exceptions import MlflowException

            try:
                mlflow.tracking.MlflowClient().get_run(run_id)
            except MlflowException as exc:
                if getattr(exc, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
                    raise tracking.TrackingError(f"MLflow refused reading run {run_id}: {exc}") from exc
                print(
                    f"orthojob job: MLFLOW_RUN_ID {run_id} is not a run of the tracking server "
                    f"{tracking.redact(tracking.tracking_uri())}. `mlflow run --backend kubernetes` creates the "
                    "run in the workstation's tracking store: set MLFLOW_TRACKING_URI on the workstation to "
                    "the same server as KUBE_MLFLOW_TRACKING_URI (e.g. through kubectl port-forward; "
                    "docs/deploy.md, MLflow Projects on Kubernetes).",
                    file=sys.stderr,
                )
                return ExitCode.TRACKING_DENIED
    except (storage.StorageError, tracking.TrackingError) as exc:
        return report_job_error("job", exc)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m orthojob.job",
        description="the whole chain into a per-Job output prefix, then registration (alias candidate)",
        epilog="exit codes: "
        + "; ".join(f"{int(c)} {c.meaning}" for c in ExitCode if c not in (ExitCode.KILLED,)),
    )
    p.add_argument("--preset", default="qwen2.5-3b", help="pipeline/train preset (default qwen2.5-3b)")
    p.add_argument(
        "--model",
        default="",
        help="base model: hub id, s3://bucket/prefix or a folder on a volume ('' = the preset's)",
    )
    p.add_argument("--steps", type=int, default=300, help="GRPO steps (default 300)")
    p.add_argument("--task-id", default="task_easy", help="task (default task_easy)")
    p.add_argument(
        "--from-checkpoint",
        default="",
        help="a gated SFT checkpoint: skip the SFT stages and their gates ('' = full chain)",
    )
    p.add_argument(
        "--stages",
        default="",
        help="the training stages, comma-separated, e.g. format_sft,tool_sft,grpo ('' = the preset's; full chain only)",
    )
    p.add_argument("--out", default="", help="the exact output prefix (default: --out-base/--run-name)")
    p.add_argument("--out-base", default="", help="where per-run prefixes go (the ConfigMap's OUTPUT_URI)")
    p.add_argument("--run-name", default="", help="continue this named run ('' = <job name>-<uid[:8]>)")
    p.add_argument("--use-vllm", action="store_true", help="GRPO generation with vLLM (train path)")
    p.add_argument(
        "--vllm-server-url",
        default="",
        help="GRPO generation on this vLLM server (needs --from-checkpoint; implies --use-vllm, server mode)",
    )
    p.add_argument(
        "--vllm-server-timeout",
        type=float,
        default=1800.0,
        help="seconds TRL waits for the vLLM server's /health at start (default 1800: the server may "
        "still be pulling its image and loading the model; TRL's own default is 240)",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="oneshot",
        help="GRPO's mode: oneshot (the whole plan, default) or agentic (the environment's tools)",
    )
    p.add_argument(
        "--env-url",
        default="",
        help="agentic mode: the environment server's URL (python -m server.app; '' = tools in process)",
    )
    p.add_argument("--model-name", default=DEFAULT_MODEL_NAME, help="registered model name")
    p.add_argument("--no-register", action="store_true", help="stop after the gates and the evaluation")
    p.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit")
    return p


def main(
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    cli: Callable[[list[str]], int] | None = None,
) -> int:
    env = os.environ if env is None else env
    install_termination_handler()  # SIGTERM anywhere: exit 143 now, not SIGKILL after the grace period
    args = build_parser().parse_args(argv)
    try:
        p = plan(args, env)
    except ValueError as exc:
        print(f"orthojob job: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    if args.dry_run:
        print(json.dumps({"out": p.out, "chain": p.chain, "register": p.register}, indent=1))
        return 0
    if needs_gpu(args) and not cuda_available() and env.get(ALLOW_CPU_ENV) != "1":
        print(
            f"orthojob job: preset {args.preset!r} (model {args.model or 'of the preset'}) needs a GPU and "
            f"CUDA is not available here. Run it on a GPU node, use --preset tiny-cpu, or set "
            f"{ALLOW_CPU_ENV}=1 to train on CPU anyway.",
            file=sys.stderr,
        )
        return ExitCode.USAGE
    if cli is None:
        cli = cli_main
    print(f"[job] output prefix {p.out}")
    for note in p.notes:
        print(f"[job] {note}")
    code = preflight(p, env)
    if code:
        return code
    print(f"[job] orthojob {' '.join(p.chain)}", flush=True)

    try:
        code = int(cli(p.chain) or 0)
        if code != 0 or not p.register:
            return code
        if _given(env.get("RANK")) not in ("", "0"):  # several ranks (TrainJob): rank 0 registers
            return code
        run_id = grpo_run_id(p)
        if not run_id:
            print("orthojob job: the chain passed but its GRPO run id was not found", file=sys.stderr)
            return ExitCode.FAILURE
        print(f"[job] orthojob promote --run-id {run_id} --model-name {p.model_name}", flush=True)
        return int(cli(["promote", "--run-id", run_id, "--model-name", p.model_name]) or 0)
    except (TrackingError, StorageError) as exc:
        return report_job_error("job", exc)


if __name__ == "__main__":
    sys.exit(main())
