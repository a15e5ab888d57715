"""The ``crawl2chat`` command line (alias ``c2c``)."""

from __future__ import annotations

import inspect
import os
import signal
import sys
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperCommand

from crawl2chat.infra.prefect_runtime import (configure_prefect_env, flow_settings, start_embedded_api,
                                             wait_for_embedded_api)
from crawl2chat.stages.training.registry import STAGES


class _Command(TyperCommand):
    """A command that, once its arguments are parsed (not for ``--help``), ties every
    process it starts (Prefect's API, Ray, training) to its own life."""

    def invoke(self, ctx):
        from crawl2chat.stages.lifetime import hold_lifeline

        hold_lifeline()
        return super().invoke(ctx)


class _App(typer.Typer):
    def command(self, *args, **kwargs):
        kwargs.setdefault("cls", _Command)
        return super().command(*args, **kwargs)


app = _App(add_completion=False, no_args_is_help=True,
           help="From raw web pages to an aligned chat model.\n\n"
                "Example: crawl2chat run   (the whole chain on this machine; then crawl2chat chat "
                "--model runs/ppo/model)")


@app.callback()
def _entry(verbose: bool = typer.Option(False, "--verbose", "-v",
                                        help="Show the libraries' own notices too (MLflow, Ray, DeepSpeed); "
                                             "they always reach the log files.")) -> None:
    from crawl2chat.infra.console import VERBOSE_ENV, quiet_libraries

    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    quiet_libraries()


CONFIG_OPT = typer.Option(None, "--config", "-c", help="YAML configuration file.")
SET_OPT = typer.Option(None, "--set", help="Override a config field: KEY.PATH=VALUE (repeatable).")


def _load(config: Optional[Path], overrides: dict, sets: Optional[list[str]], preset: dict | None = None):
    from crawl2chat.stages.settings import SettingsError, load_config, parse_override

    try:
        merged = dict(preset or {})
        merged.update(parse_override(s) for s in (sets or []))
        merged.update({k: v for k, v in overrides.items() if v not in (None, [], ())})
        return load_config(config, merged)
    except SettingsError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)


def _fail(message: str, status: int = 1) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(status)


def _prepare_services(cfg) -> None:
    """Prefect's environment, after checking the project folder (``home``) the embedded
    Prefect API and MLflow store would live in: a folder that cannot be written ends
    the command with one sentence and exit status 2."""
    from crawl2chat.infra.workdir import FolderUnusable, check_home

    embedded_prefect = not os.environ.get("PREFECT_API_URL")
    if embedded_prefect or not (cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")):
        try:
            check_home(cfg.home)
        except FolderUnusable as e:
            _fail(str(e), 2)
    configure_prefect_env(cfg.home)
    if embedded_prefect:
        start_embedded_api(cfg.home)  # comes up while the command imports its stages


@app.command()
def data(
    paths: Optional[list[str]] = typer.Argument(
        None, metavar="PATH", help="More WARC/WET files or folders, as --input (the files an unquoted "
        "glob after --input expands to land here)."),
    input: Optional[list[str]] = typer.Option(None, "--input", "-i", help="WARC/WET file, folder or glob (repeatable); local or fsspec URL."),
    seed_url: Optional[list[str]] = typer.Option(None, "--seed-url", help="Crawl from this URL first (repeatable)."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Output folder."),
    refresh: bool = typer.Option(False, "--refresh", help="Add only new/changed pages to the dataset in --out as a new version."),
    config: Optional[Path] = CONFIG_OPT,
    set_: Optional[list[str]] = SET_OPT,
) -> None:
    """Web pages -> clean, language-tagged, deduplicated Parquet shards (a new dataset version).

    Example: crawl2chat data --input crawl/*.warc.gz --out runs/data   (add --refresh for a new version)
    """
    inputs = [*(input or []), *(paths or [])]
    cfg = _load(config, {"data.inputs": inputs, "data.seed_urls": seed_url, "data.out": out,
                         "data.refresh": True if refresh else None}, set_)
    _prepare_services(cfg)
    from crawl2chat.flows.data import data_flow

    manifest = _guarded(lambda: data_flow(cfg), cfg, meanwhile=_data_step_imports(cfg))
    out_dir = Path(cfg.data.out).resolve()
    typer.echo(
        f"\n{manifest['version']}: {manifest['documents_kept']} documents ({manifest['version_documents_kept']} new), "
        f"{manifest['documents_dropped']} dropped.\n{_unreadable_line(manifest, '  ')}"
        f"  shards:   {out_dir / 'shards'}\n  rejected: {out_dir / 'rejected'}\n"
        f"  manifest: {out_dir / 'manifest.json'}\n  review:   {out_dir / 'review.md'}\n"
        f"  MLflow:   {_mlflow_hint(cfg)}"
    )


def _unreadable_line(manifest: dict, indent: str) -> str:
    """The summary's line on the input files this build could not read (what they held
    before the error is kept), or nothing when it read them all."""
    from crawl2chat.stages.data.pipeline import input_problems

    bad = manifest.get("unreadable_files") or []
    if not bad:
        return ""
    return f"{indent}unreadable: {len(bad)} of {len(manifest['files'])} input files, see manifest.json ({input_problems(bad)})\n"


def _mlflow_hint(cfg) -> str:
    from crawl2chat.infra.tracking import tracking_uri

    uri = tracking_uri(cfg.home, cfg.tracking.uri)
    if uri.startswith("sqlite:"):
        return f"{uri}  (browse: mlflow ui --backend-store-uri {uri})"
    return uri


@app.command()
def train(
    data: str = typer.Option(..., "--data", help="A data-stage output folder (its current version is read)."),
    config: Optional[Path] = CONFIG_OPT,
    set_: Optional[list[str]] = SET_OPT,
) -> None:
    """Every training stage from existing shards: base model, SFT, reward model, PPO (DPO when enabled).

    Example: crawl2chat train --data runs/data --set pretrain.train.max_steps=2000
    """
    cfg = _load(config, {}, set_)
    _prepare_services(cfg)
    from crawl2chat.flows.pipeline import train_flow

    result = _guarded(lambda: train_flow(cfg, data), cfg, meanwhile=_module_imports(STAGES["pretrain"].module, "transformers"))
    typer.echo("\n".join(f"{name + ' model:':<14} {result[name]['model_dir']}"
                          for name in ("pretrain", "sft", "reward", "ppo", "dpo") if name in result))


def _open_tracking(cfg) -> None:
    """Open the MLflow store and load the plotting library while the local Prefect API
    comes up: neither needs Prefect, and a flow's first steps need both. For a small
    ``crawl2chat data`` the two took 1.3 s and 0.55 s after the API server answered
    (it answered 1.9 s after the command's imports). A failure here is left to the
    flow, which opens the store again as its first step and reports it there; so only a
    store in a local file is opened here (a tracking server that does not answer would
    be waited for twice)."""
    try:
        from crawl2chat.infra.records import load_plotting
        from crawl2chat.infra.tracking import setup_tracking, tracking_uri

        if tracking_uri(cfg.home, cfg.tracking.uri).startswith("sqlite:"):
            setup_tracking(cfg.home, cfg.tracking.experiment, cfg.tracking.uri)
        load_plotting()
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def _data_step_imports(cfg) -> list:
    """Importing the data steps' costliest libraries and warming the extractor up, in the
    order the steps need them, as work for the wait on the local API."""
    import functools

    from crawl2chat.stages.data.extract import warm_up
    from crawl2chat.stages.data.pipeline import step_libraries

    # The first step's extractor first (its warm-up imports it), then the later steps' libraries.
    return [functools.partial(warm_up, cfg.data.extract.extractor), *_module_imports(*step_libraries(cfg.data))]


def _module_imports(*modules: str) -> list:
    """Importing ``modules`` (the data steps' libraries; a training stage's script and
    transformers, ~2-3 s), as work for the wait on the local API."""
    import functools
    import importlib

    return [functools.partial(importlib.import_module, name) for name in modules]


def _check_prefect_server() -> None:
    """A Prefect server named by ``PREFECT_API_URL`` that does not answer: one sentence, before any work."""
    from crawl2chat.infra.prefect_runtime import configured_api_url
    from crawl2chat.infra.services import require

    if url := configured_api_url():
        require("Prefect server", url, "PREFECT_API_URL")


def _guarded(body, cfg=None, meanwhile=()):
    """Run a flow; a failure that a rerun cannot fix (bad settings or data, divergence,
    a full disk) ends in one sentence and exit status 2, the full trace being in the
    stage's log or ``HOME/logs/flow-runs.log``. ``meanwhile``: work done while the local
    Prefect API comes up (:func:`wait_for_embedded_api`)."""
    from crawl2chat.infra.console import RUN_TRACES
    from crawl2chat.stages.data.pipeline import NothingUsableError
    from crawl2chat.stages.data.versions import DamagedDataError
    from crawl2chat.stages.locks import FolderBusy
    from crawl2chat.infra.services import ServiceUnreachable, on_lost, service_lost
    from crawl2chat.stages.settings import SettingsError
    from crawl2chat.stages.training.failures import StageFailed

    home = cfg.home if cfg is not None else None
    try:
        _check_prefect_server()
        if cfg is not None:
            _open_tracking(cfg)
    except ServiceUnreachable as e:
        _fail(str(e), 2)
    try:
        wait_for_embedded_api(meanwhile)
    except RuntimeError as e:
        _fail(str(e))
    from prefect.exceptions import TerminationSignal

    def stop(signum, frame):  # noqa: ARG001 - a signal handler's signature
        raise TerminationSignal(signal=signum)

    # SIGTERM raises here as in a flow run (Prefect's own handler, once a flow has ended
    # its runs, sends the signal again to the handler it found: this one, not death).
    previous = signal.signal(signal.SIGTERM, stop)
    said = []

    def last_words(sentence: str) -> None:  # a watched service went away and this thread is held up
        if cfg is not None:
            from crawl2chat.infra.tracking import close_own_runs

            close_own_runs()
        if not said:
            typer.echo(f"error: {sentence}", err=True)

    on_lost(last_words)
    try:
        with flow_settings():
            return body()
    except (KeyboardInterrupt, TerminationSignal) as e:
        # Stopped on purpose (Ctrl-C, SIGTERM): the MLflow runs are closed KILLED, and the
        # status is the shell's for that signal.
        if (sentence := service_lost()) is not None:  # a watched service went away: not the user's stop
            said.append(sentence)
            _fail(sentence, 1)
        sig = getattr(e, "signal", signal.SIGINT)
        typer.echo(f"stopped ({signal.Signals(sig).name}); rerunning the same command resumes where it stopped",
                   err=True)
        raise typer.Exit(128 + sig) from None
    except StageFailed as e:
        # The script's log, or where the command's own traces go when it failed before a script wrote one.
        # An empty log (the stage failed before its script wrote a line) points nowhere useful.
        written = e.log_path and Path(e.log_path).exists() and Path(e.log_path).stat().st_size > 0
        log = e.log_path if written else (Path(home) / RUN_TRACES if home else None)
        if not e.permanent:  # a rerun may get past it, and resumes from the last checkpoint
            _fail(f"{e.stage}: {e.message}; rerunning the command resumes (full log: {log})", 1)
        _fail(f"{e.stage}: {e.message} (full log: {log})", 2)
    except ServiceUnreachable as e:
        _fail(str(e), 2)
    except (NothingUsableError, DamagedDataError, FileNotFoundError, FolderBusy, SettingsError,
            NotADirectoryError, IsADirectoryError, PermissionError, FileExistsError) as e:
        traces = Path(home) / RUN_TRACES if home else None
        # An OSError of the system's own words ("[Errno 20] Not a directory: 'x'") reads better as "x: Not a directory".
        said = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename and e.strerror else f"{e}"
        if isinstance(e, FileExistsError) and e.filename:
            said = f"{e.filename} is in the way: a folder is needed there and it is a file"
        _fail(said + (f" (trace: {traces})" if traces and traces.exists() else ""), 2)
    except Exception as e:  # noqa: BLE001 - out of disk space, a file size limit or memory: a rerun fails again
        # It may arrive wrapped: Prefect's API answering 500 to the failed task's state, its
        # own database having met the same limit.
        from crawl2chat.infra.tracking import tracking_lost
        from crawl2chat.stages.resources import exhaustion

        if (sentence := exhaustion(e)) is not None:
            _fail(sentence, 2)
        if (sentence := tracking_lost(e)) is not None:  # a rerun records it once the server is back
            _fail(sentence, 1)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stage_command(name: str):
    """The ``crawl2chat <stage>`` command of a registry entry: its inputs as options,
    plus --out, --max-steps, --num-processes, the stage's shortcuts, --config, --set."""
    stage = STAGES[name]

    def command(**kw) -> None:
        max_steps = kw.pop("max_steps")
        overrides = {f"{name}.out": kw.pop("out"), f"{name}.train.max_steps": max_steps,
                     f"{name}.num_processes": kw.pop("num_processes")}
        for setting, _ in stage.options:
            overrides[f"{name}.train.{setting}"] = kw.pop(setting)
        sets = kw.pop("set_")
        for item in sets or []:  # another stage's setting would be accepted and never read here
            section = item.split("=", 1)[0].strip().split(".", 1)[0]
            if section not in (name, "home", "tracking"):
                _fail(f"--set {item.split('=', 1)[0].strip()}: the {name} command reads only {name}.*, home and "
                      f"tracking.* (the {section} settings take effect in crawl2chat {section if section in (*STAGES, 'data') else 'run'})", 2)
        cfg = _load(kw.pop("config"), overrides, sets)
        if max_steps is not None and getattr(getattr(cfg, name), "minutes", None) is not None:
            getattr(cfg, name).minutes = None  # the steps asked for, not what fits in the minutes
        _prepare_services(cfg)
        from crawl2chat.flows.pipeline import stage_flow

        summary = _guarded(lambda: stage_flow(name)(cfg, **kw), cfg, meanwhile=_module_imports(stage.module, "transformers"))
        typer.echo(f"\n{name} model: {summary['model_dir']}\n  {stage.report(summary)}\n"
                   f"  MLflow: {summary.get('model_uri')} (run {summary['run_id']})")

    P = inspect.Parameter
    params = [P(i.name, P.KEYWORD_ONLY, annotation=str, default=typer.Option(..., f"--{i.name}", help=i.help))
              for i in stage.inputs]
    params += [
        P("out", P.KEYWORD_ONLY, annotation=Optional[str],
          default=typer.Option(None, "--out", "-o", help="Run folder; re-running on it resumes.")),
        P("max_steps", P.KEYWORD_ONLY, annotation=Optional[int],
          default=typer.Option(None, "--max-steps", help=stage.max_steps_help)),
        P("num_processes", P.KEYWORD_ONLY, annotation=Optional[int],
          default=typer.Option(None, "--num-processes", help="Processes (DDP when > 1).")),
        *(P(setting, P.KEYWORD_ONLY, annotation=Optional[str], default=typer.Option(None, f"--{setting}", help=h))
          for setting, h in stage.options),
        P("config", P.KEYWORD_ONLY, annotation=Optional[Path], default=CONFIG_OPT),
        P("set_", P.KEYWORD_ONLY, annotation=Optional[list[str]], default=SET_OPT),
    ]
    command.__signature__ = inspect.Signature(params, return_annotation=None)
    command.__name__ = name
    example = " ".join(f"--{i.name} {i.default or 'FILE'}" for i in stage.inputs)
    command.__doc__ = f"{stage.goal}\n\nExample: crawl2chat {name} {example} --max-steps 100"
    app.command(name)(command)


for _name in STAGES:
    _stage_command(_name)


@app.command()
def run(
    refresh: bool = typer.Option(False, "--refresh", help="Add only new/changed pages to the existing dataset."),
    preset: str = typer.Option("default", "--preset", help="Size of the run: default (minutes on a laptop), "
                               "large (hours on CPU, minutes on a GPU), gpu (a 124M model)."),
    config: Optional[Path] = CONFIG_OPT,
    set_: Optional[list[str]] = SET_OPT,
) -> None:
    """The main job, end to end on the embedded default (local Ray, Prefect, MLflow).

    Example: crawl2chat run            (then: crawl2chat chat --model runs/ppo/model)
    """
    from crawl2chat.stages.settings import RUN_PRESETS

    if preset not in RUN_PRESETS:
        _fail(f"--preset {preset!r}: choose one of {', '.join(RUN_PRESETS)}", 2)
    expected, overlay = RUN_PRESETS[preset]
    cfg = _load(config, {"data.refresh": True if refresh else None}, set_, overlay)
    typer.echo(f"crawl2chat run --preset {preset}: expect {expected}.")
    _prepare_services(cfg)
    from crawl2chat.flows.pipeline import pipeline_flow

    result = _guarded(lambda: pipeline_flow(cfg), cfg, meanwhile=_data_step_imports(cfg))
    manifest, base = result["manifest"], result["pretrain"]
    data_out = Path(result["data"])
    lines = [
        f"\nDone. {manifest['documents_kept']} documents kept, {manifest['documents_dropped']} dropped.",
        *filter(None, [_unreadable_line(manifest, "  ").rstrip("\n")]),
        f"  dataset:      {data_out / 'manifest.json'}  (version {manifest['version']}, {len(manifest['shards'])} shards"
        f" in {data_out / 'shards'}; review.md, rejected/ beside it)",
        f"  base model:   {base['model_dir']}  (val_bpb {base['val_bpb']:.3f} at training's last evaluation, "
        f"on held-out split {base.get('split', 'none recorded')}; every evaluation reads only that split)",
        f"  SFT model:    {result['sft']['model_dir']}",
        f"  reward model: {result['reward']['model_dir']}  ({STAGES['reward'].report(result['reward'])})",
        f"  PPO policy:   {result['ppo']['model_dir']}  ({STAGES['ppo'].report(result['ppo'])})",
    ]
    if "dpo" in result:
        lines.append(f"  DPO policy:   {result['dpo']['model_dir']}")
    lines += [f"  MLflow:       {_mlflow_hint(cfg)}  parent run {result['run_id']}",
              f"  lineage:      crawl2chat lineage {result['ppo']['model_dir']}"]
    lines += _figures(result) + _side_by_side(result.get("showcase") or [])
    lines.append(f"\nTalk to it: crawl2chat chat --model {result['ppo']['model_dir']}")
    typer.echo("\n".join(lines))


def _fmt(value, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "n/a"


def _figures(result: dict) -> list[str]:
    """The evaluation figures of the chain, one line per model."""
    base, ppo = result["pretrain"], result["ppo"]
    ev = base.get("eval") or {}
    lines = ["", "Figures (held-out pages and questions no stage trained on):",
             f"  base model   bits per byte {_fmt(ev.get('eval.lm.bpb', base.get('val_bpb')))} at the end-of-stage "
             f"evaluation (unigram baseline {_fmt(base.get('unigram_bpb'))}); multiple choice on held-out pages "
             f"{_fmt(ev.get('eval.mc.acc_norm'))} per byte, {_fmt(ev.get('eval.mc.acc'))} summed "
             f"(chance {_fmt(ev.get('eval.mc.chance'))}, {_fmt(ev.get('eval.mc.n'), '.0f')} tasks)"]
    sft_ev = result["sft"].get("eval") or {}
    lines.append(f"  SFT model    bits per byte {_fmt(sft_ev.get('eval.lm.bpb'))}; val_loss on held-out chats "
                 f"{_fmt(result['sft'].get('val_loss'))}")
    lines.append(f"  reward model held-out pair accuracy {_fmt(result['reward'].get('eval_accuracy'))}")
    pev = ppo.get("eval") or {}
    quarters = (f" (mean of the first {ppo['quarter']} rollouts {_fmt(ppo.get('reward_mean_first_quarter'))} -> "
                f"of the last {ppo['quarter']} {_fmt(ppo.get('reward_mean_last_quarter'))})" if ppo.get("quarter") else "")
    lines.append(f"  PPO policy   reward {_fmt(ppo.get('reward_mean_first'))} -> {_fmt(ppo.get('reward_mean_last'))}"
                 f"{quarters}; win rate vs SFT {_fmt(pev.get('eval.policy.win_rate'))} (ties count half)")
    if questions := result.get("questions"):
        first = next(iter(questions.values()))
        picks = ", ".join(f"{name} {_fmt(q.get('acc_norm'))}" for name, q in questions.items())
        lines.append(f"  questions    the page's answer picked among {round(1 / first['chance'])} (per byte): {picks} "
                     f"(chance {_fmt(first['chance'])}, {first.get('n', 0)} questions on pages no set used)")
    return lines


def _side_by_side(rows: list[dict], width: int = 100) -> list[str]:
    """Held-out questions with each model's answer under the page's own."""
    lines = []
    for row in rows:
        lines += ["", f"Q: {row['prompt']}", f"  page: {row.get('reference', '')[:width]}"]
        lines += [f"  {name + ':':<5} {(row.get(name) or '').replace(chr(10), ' ')[:width]}" for name in ("base", "sft", "ppo")]
    return lines


@app.command()
def lineage(
    ref: str = typer.Argument(..., help="A run id, models:/NAME/VERSION, models:/NAME@ALIAS, or a model folder."),
    config: Optional[Path] = CONFIG_OPT,
) -> None:
    """Print the chain data -> tokenizer/base model -> SFT -> reward model -> policy around a model or run.

    Example: crawl2chat lineage runs/ppo/model   (or a run id, or models:/crawl2chat-policy@current)
    """
    cfg = _load(config, {}, None)
    import mlflow

    from crawl2chat.infra.lineage import format_lineage, recorded_store
    from crawl2chat.infra.tracking import setup_tracking

    configured = cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
    here = Path(cfg.home) / "mlflow.db"
    if configured or here.exists():
        setup_tracking(cfg.home, cfg.tracking.experiment, cfg.tracking.uri)
    elif store := recorded_store(ref):  # run elsewhere: the store the model's training recorded itself in
        mlflow.set_tracking_uri(store)
    else:  # a lookup makes no store of its own
        _fail(f"no MLflow store here ({here.resolve()} does not exist) and {ref!r} names no model folder that "
              "records one: run from the project folder, or point --set home=DIR or MLFLOW_TRACKING_URI at it.", 2)
    try:
        typer.echo(format_lineage(ref))
    except Exception as e:  # noqa: BLE001 - a bad reference gets one plain line, not a traceback
        _fail(f"cannot resolve {ref!r}: {e}", 2)


@app.command("serve-flows")
def serve_flows(
    refresh_cron: str = typer.Option("0 3 * * *", "--refresh-cron", help="Cron schedule of the data refresh (UTC)."),
    crash_after: int = typer.Option(
        90, "--crash-after",
        help="Seconds without a heartbeat after which the server marks a crawl2chat flow run Crashed "
             "(a Prefect automation this command creates or updates; 0: leave the server's automations alone)."),
) -> None:
    """Serve the pipeline, data-refresh, train and single-stage flows to a Prefect server (set PREFECT_API_URL).

    Example: PREFECT_API_URL=http://127.0.0.1:4200/api crawl2chat serve-flows --refresh-cron "0 3 * * *"
    """
    configure_prefect_env(terse=False)
    # Served runs beat every 30 s, so a run whose process died (a killed serve-flows, a lost
    # machine) is marked Crashed by the automation below instead of showing Running for ever.
    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "30")
    from crawl2chat.flows.automations import NAME, crash_after_problem, ensure_crash_automation

    problem = crash_after_problem(crash_after)
    if problem:
        _fail(f"--crash-after {problem}.", 2)
    from prefect import serve
    from prefect.settings import get_current_settings

    from crawl2chat.flows.deployments import in_work_pools, served

    api = get_current_settings().api.url  # the environment's, or the active Prefect profile's
    if not api:
        _fail("serve-flows needs a Prefect server: set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api "
              "after `prefect server start`).", 2)
    if crash_after:
        try:
            ensure_crash_automation(crash_after)
        except Exception as e:  # noqa: BLE001 - unreachable or refusing server: one sentence
            _fail(f"could not create the automation '{NAME}' on the Prefect server {api}: "
                  f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", 2)
        typer.echo(f"automation '{NAME}': flow runs silent for {crash_after} s are marked Crashed")
    deployments = served(refresh_cron)
    taken = in_work_pools(deployments)
    if taken:
        _fail(f"serve-flows would replace {len(taken)} deployments this server runs through a work pool "
              f"({', '.join(taken[:2])}{', ...' if len(taken) > 2 else ''}; made by `prefect deploy`): keep using "
              "the work pool's worker, or delete those deployments first (prefect deployment delete NAME).", 2)
    serve(*deployments)


from crawl2chat.serving_cli import register as _register_serving  # noqa: E402

_register_serving(app)


# What a command stopped by a signal adds to "stopped (SIGTERM)" when a rerun has nothing to resume.
STOPPED_PLAINLY = {"serve": "", "chat": "", "eval": "", "lineage": "", "serve-flows": "",
                   "export": "; the previous export, if any, is kept"}


def main() -> None:  # pragma: no cover
    """The console script: the command's status, and an exit without the interpreter's
    teardown (:func:`crawl2chat.stages.lifetime.exit_now`)."""
    from crawl2chat.stages.lifetime import exit_now

    command = next((a for a in sys.argv[1:] if not a.startswith("-")), "")

    def stopped_before_work(signum, frame):  # noqa: ARG001 - a signal handler's signature
        # SIGTERM while the command imports and starts up (its own handler, which closes the
        # MLflow runs, is installed once there is work to stop): the same words, nothing to close.
        # The commands with nothing to resume (a server that has drained its requests, as
        # uvicorn sends the signal on once it has, a chat, an evaluation) say only that they stopped.
        said = STOPPED_PLAINLY.get(command, "; rerunning the same command resumes where it stopped")
        print(f"stopped ({signal.Signals(signum).name}){said}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped_before_work)
    try:
        code = app()
    except SystemExit as e:
        code = e.code
    if isinstance(code, str):  # a message instead of a status, as sys.exit prints it
        print(code, file=sys.stderr)
        code = 1
    exit_now(code or 0)


if __name__ == "__main__":  # pragma: no cover
    main()
