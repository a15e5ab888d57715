"""``crawl2chat eval | export | serve | chat``: evaluation, export and serving of a model folder."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Optional

import typer

QUANTIZE_HELP = "Dynamic int8 quantisation of the linear layers at load time (CPU): none or int8."


def _check_model(model: str, flag: str = "--model", kind: str = "causal") -> None:
    """One sentence and status 2 for a folder the command cannot use (a causal LM is needed
    to generate and to score bits per byte; ``--reward-model`` needs a reward model)."""
    from crawl2chat.stages.training.models import model_folder_problem

    if problem := model_folder_problem(model, kind):
        typer.echo(f"error: {flag}: {problem}", err=True)
        raise typer.Exit(2)


@contextlib.contextmanager
def _readable_models():
    """One sentence and status 2 for a model folder whose files cannot be loaded (a file
    truncated or missing where no checksum list says so first, a bad serving.json)."""
    from crawl2chat.stages.inference.generation import ModelUnreadable

    try:
        yield
    except ModelUnreadable as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)


def _check_paths(*flags: tuple[str, Optional[str]]) -> None:
    """One sentence and status 2 for an input file or folder given and not there."""
    for flag, path in flags:
        if path and not Path(path).exists():
            typer.echo(f"error: {flag}: {path} does not exist", err=True)
            raise typer.Exit(2)


def _check_listen(host: str, port: int) -> None:
    """One sentence and status 2, before the model loads, for an address the server could
    not listen on (a port out of range or taken, a host that names no interface here);
    uvicorn would say it after loading the model, and end with its own shutdown lines."""
    import socket

    if not 0 <= port <= 65535:
        typer.echo(f"error: --port takes 0 to 65535, not {port}", err=True)
        raise typer.Exit(2)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        typer.echo(f"error: --host: {host} names no address here ({e.strerror})", err=True)
        raise typer.Exit(2)
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            typer.echo(f"error: --host/--port: cannot listen on {host}:{port} ({e.strerror.lower()})", err=True)
            raise typer.Exit(2)


def _check_quantize(quantize: Optional[str]) -> None:
    if quantize not in (None, "none", "int8"):
        typer.echo(f"error: --quantize takes none or int8, not {quantize!r}", err=True)
        raise typer.Exit(2)


def eval_command(
    model: str = typer.Option(..., "--model", "-m", help="Model folder (Hugging Face layout)."),
    data: Optional[str] = typer.Option(None, "--data", help="Parquet shards folder or text file, read through --split."),
    split: str = typer.Option("model", "--split", help="model: only documents held out by the split recorded "
                              "with the model (all of --data when it records none); all: every document."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Write the results as JSON here."),
    mc_tasks: int = typer.Option(100, "--mc-tasks", help="Multiple-choice tasks generated from --data (0: none)."),
    max_tokens: int = typer.Option(200_000, "--max-tokens", help="Cap on scored held-out tokens."),
    chat: bool = typer.Option(False, "--chat", help="Sample generations through the chat template."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help=QUANTIZE_HELP),
    reward_model: Optional[str] = typer.Option(None, "--reward-model", help="Reward model folder."),
    pairs: Optional[str] = typer.Option(None, "--pairs", help="JSONL {prompt, chosen, rejected}: RM accuracy."),
    parent: Optional[str] = typer.Option(None, "--parent", help="SFT parent: win rate and KL of --model against it."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="Held-out prompts for --parent (JSONL or lines)."),
) -> None:
    """Bits per byte, perplexity, multiple choice and sample generations of a model.

    Example: crawl2chat eval --model runs/pretrain/model --data runs/data   (its held-out split only)
    """
    _check_model(model)
    for flag, folder, kind in (("--reward-model", reward_model, "reward"), ("--parent", parent, "causal")):
        if folder:
            _check_model(folder, flag, kind)
    _check_quantize(quantize)
    if split not in ("model", "all"):
        typer.echo(f"error: --split takes model or all, not {split!r}", err=True)
        raise typer.Exit(2)
    _check_paths(("--data", data), ("--pairs", pairs), ("--prompts", prompts))
    for flag, value, least in (("--max-tokens", max_tokens, 1), ("--mc-tasks", mc_tasks, 0)):
        if value < least:
            typer.echo(f"error: {flag} takes a whole number of at least {least}, not {value}", err=True)
            raise typer.Exit(2)
    if out and Path(out).is_dir():
        typer.echo(f"error: --out: {out} is a folder; --out takes the JSON file to write", err=True)
        raise typer.Exit(2)
    from crawl2chat.stages.inference.evaluate import main

    argv = ["--model", model, "--mc-tasks", str(mc_tasks), "--max-tokens", str(max_tokens),
            "--quantize", quantize or "none", "--split", split]
    for flag, value in (("--data", data), ("--out", out), ("--reward-model", reward_model), ("--pairs", pairs),
                        ("--parent", parent), ("--prompts", prompts)):
        if value:
            argv += [flag, value]
    if chat:
        argv.append("--chat")
    with _readable_models():
        main(argv)


def export_command(
    model: str = typer.Option(..., "--model", "-m", help="Model folder (Hugging Face layout)."),
    out: str = typer.Option(..., "--out", "-o", help="Exported folder."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help="int8: measure it against fp32 and serve the folder with it."),
    data: Optional[str] = typer.Option(None, "--data", help="Held-out text for the fp32/int8 bits-per-byte comparison."),
    compile_check: bool = typer.Option(False, "--compile-check", help="Measure torch.compile against eager decoding; serve compiled only if faster."),
) -> None:
    """Add generation config and chat template, check the reload, optionally measure int8.

    Example: crawl2chat export --model runs/ppo/model --out exported/policy --quantize int8
    """
    _check_model(model)
    _check_quantize(quantize)
    _check_paths(("--data", data))
    from crawl2chat.stages.inference.export import REPORT, export_model
    from crawl2chat.stages.locks import FolderBusy

    try:
        with _readable_models():
            report = export_model(model, out, quantize=quantize, data=data, compile_check=compile_check)
    except FolderBusy as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1)
    except (FileExistsError, PermissionError, NotADirectoryError) as e:
        said = f"{e.filename}: {e.strerror}" if e.filename and e.strerror else f"{e}"
        typer.echo(f"error: --out: {said}", err=True)
        raise typer.Exit(2)
    r = report["reload"]
    typer.echo(f"exported to {report['out']}\n  reload: max |logit diff| {r['max_abs_logit_diff']:.2e}, "
               f"stop tokens {r['eos_token_id']}")
    if "int8" in report:
        q = report["int8"]
        typer.echo(f"  {'':6} {'prefill ms':>11} {'decode tok/s':>13} {'bpb':>8}")
        for side in ("fp32", "int8"):
            s = q[side]
            bpb = f"{s['bpb']:.4f}" if "bpb" in s else "-"
            typer.echo(f"  {side:6} {s['prefill_ms']:11.2f} {s['decode_tokens_per_s']:13.1f} {bpb:>8}")
        typer.echo(f"  decode speed-up x{q['decode_speedup']:.2f}, prefill x{q['prefill_speedup']:.2f}"
                   + (f", bpb change {q['bpb_change']:+.4f}" if "bpb_change" in q else ""))
    if "compile" in report:
        c = report["compile"]
        verdict = "kept" if c["kept"] else "not kept"
        detail = f"decode x{c['decode_speedup']:.2f}" if "decode_speedup" in c else c.get("error", "")
        typer.echo(f"  torch.compile: {detail}, {verdict}")
    typer.echo(f"  report: {Path(report['out']) / REPORT}")


def serve_command(
    model: str = typer.Option(..., "--model", "-m", help="Model folder (Hugging Face layout)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on."),
    port: int = typer.Option(8000, "--port", "-p", help="TCP port."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help=QUANTIZE_HELP + " Default: the folder's serving.json."),
    max_concurrent: int = typer.Option(4, "--max-concurrent", help="Requests generating at once (at least 1)."),
    max_queue: int = typer.Option(16, "--max-queue", help="Requests waiting beyond those; more get 503."),
    max_tokens: int = typer.Option(1024, "--max-tokens", help="Largest max_tokens a request may ask for."),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", help="Larger request bodies get 413."),
    max_messages: int = typer.Option(256, "--max-messages", help="Chat messages per request; more get 400."),
    max_prompt_chars: int = typer.Option(65_536, "--max-prompt-chars",
                                         help="Prompt (all message contents) in characters; longer get 400."),
    max_prompt_tokens: Optional[int] = typer.Option(None, "--max-prompt-tokens",
                                                    help="Prompt in tokens; longer get 400. Default: the context."),
    queue_timeout: float = typer.Option(30.0, "--queue-timeout", help="Seconds a request may wait for a slot; then 503."),
    request_timeout: float = typer.Option(300.0, "--request-timeout",
                                          help="Seconds an admitted request may run; then its generation stops."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="CRAWL2CHAT_API_KEY", show_envvar=True,
                                          help="Require 'Authorization: Bearer KEY' on every route but /health."),
    cors_origin: Optional[list[str]] = typer.Option(None, "--cors-origin",
                                                    help="Origin allowed cross-origin requests (repeatable; '*': any). "
                                                         "Default: none, no CORS headers."),
) -> None:
    """HTTP server: /health, /generate (streaming) and OpenAI-compatible /v1/chat/completions.

    Example: crawl2chat serve --model runs/ppo/model --port 8000   (OpenAI base URL http://127.0.0.1:8000/v1)
    """
    _check_model(model)
    _check_quantize(quantize)
    _check_listen(host, port)
    from crawl2chat.stages.inference.serve import ServerSettings, serve

    try:
        settings = ServerSettings(
            max_concurrent=max_concurrent, max_queue=max_queue, max_tokens_limit=max_tokens,
            max_body_bytes=max_body_bytes, max_messages=max_messages, max_prompt_chars=max_prompt_chars,
            max_prompt_tokens=max_prompt_tokens, queue_timeout=queue_timeout, request_timeout=request_timeout,
            api_key=api_key, cors_origins=tuple(cors_origin or ())).validated()
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"serving {model} on http://{host}:{port}  (OpenAI base URL http://{host}:{port}/v1)"
               + ("; API key required" if settings.api_key else ""))
    if not settings.api_key and host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(f"warning: listening on {host} without an API key (--api-key or CRAWL2CHAT_API_KEY)", err=True)
    with _readable_models():
        serve(model, host=host, port=port, quantize=quantize, settings=settings)


def chat_command(
    model: str = typer.Option(..., "--model", "-m", help="Model folder (Hugging Face layout)."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help=QUANTIZE_HELP),
    system: Optional[str] = typer.Option(None, "--system", help="System message."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Largest reply, in tokens; a reply never runs "
                                    "past the model's context (oldest exchanges are forgotten to make room)."),
    temperature: float = typer.Option(0.8, "--temperature"),
    top_p: float = typer.Option(0.95, "--top-p"),
    repetition_penalty: float = typer.Option(1.2, "--repetition-penalty",
                                             help="Divide the scores of tokens already said by this (1 = off)."),
) -> None:
    """Terminal chat on the serving code path (chat template, KV-cache streaming). /reset, /exit.

    Example: crawl2chat chat --model runs/ppo/model
    """
    _check_model(model)
    _check_quantize(quantize)
    from crawl2chat.stages.inference.generation import Engine, SamplingParams, unicode_problem

    with _readable_models():
        engine = Engine(model, quantize=quantize)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            repetition_penalty=repetition_penalty)
    try:
        params.validate()
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    # The room a reply is given: --max-tokens, or half the context when that is smaller,
    # so a conversation keeps some of its past instead of one long reply filling the window.
    room = min(params.max_new_tokens, max(1, engine.max_context // 2))
    capped = f"; replies up to {room} tokens (the model's context is {engine.max_context})" \
        if room < params.max_new_tokens else ""
    typer.echo(f"{model} ({engine.quantize}){capped}; /reset clears the conversation, /exit or Ctrl-D quits.")
    if callable(getattr(sys.stdin, "reconfigure", None)):
        # Bytes the terminal's encoding cannot decode come through as lone surrogates (said
        # below), not as a UnicodeDecodeError that would end the session.
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            typer.echo("")
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            history = list(start)
            continue
        if not line.strip():
            continue
        if problem := unicode_problem(line):  # bytes the terminal's encoding could not decode
            typer.echo(f"error: the message {problem}; type it again", err=True)
            continue
        history.append({"role": "user", "content": line})
        ids = engine.chat_prompt_ids(history)
        while len(history) > 1 + len(start) and len(ids) + room > engine.max_context:
            history = start + history[len(start) + 2:]  # forget the oldest exchange
            ids = engine.chat_prompt_ids(history)
        try:
            # A long message of its own still gets what the context leaves; one that fills it
            # is refused by the engine's length check, naming both lengths.
            reply = max(1, min(params.max_new_tokens, engine.max_context - len(ids)))
            stream = engine.stream(ids, dataclasses.replace(params, max_new_tokens=reply))
        except ValueError as e:
            typer.echo(f"error: {e}", err=True)
            history.pop()
            continue
        sys.stdout.write("bot> ")
        for piece in stream.deltas():
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": stream.text})


def register(app: typer.Typer) -> None:
    """Add ``eval``, ``export``, ``serve`` and ``chat`` to the ``crawl2chat`` command line."""
    app.command("eval")(eval_command)
    app.command("export")(export_command)
    app.command("serve")(serve_command)
    app.command("chat")(chat_command)
