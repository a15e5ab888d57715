"""Connect to Ray: a local instance by default, a cluster when ``RAY_ADDRESS`` is set.

Data steps call :func:`ensure_ray` before building datasets. With no address, Ray
starts in-process on this machine with the dashboard off (it is a separate web
server most single-machine runs do not want), and every one of its servers
listens on the loopback address only. With ``RAY_ADDRESS`` (for example
``ray://head:10001`` or ``127.0.0.1:6379``) the same code runs on the cluster;
every node needs crawl2chat installed (the compose image has it), since the
functions the steps ship to workers import it there.

A local instance never outlives the process that started it, however that
process dies (SIGKILL included): Ray ties its own processes to the driver, and
the agents under the raylet learn of its death through a pipe
(``tests/faults/test_process_tree.py`` kills a driver and waits for all of them).

Ray's notices that say nothing to someone running the pipeline (its token
authentication notice, the raylet's count of worker processes, Ray Data's look
for a free CPU) stay in Ray's own log files; :mod:`crawl2chat.infra.console`
names them, and ``crawl2chat -v`` shows them on the terminal too.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import ray
from ray.data.context import ShuffleStrategy

from crawl2chat.infra.services import UNWIND_S, ServiceUnreachable, host_port, require, watch
from crawl2chat.stages.lifetime import hold_lifeline

log = logging.getLogger(__name__)


def _loopback_only() -> None:
    """Make the loopback address the local instance's node address, so that every
    server it starts (GCS, raylet, workers, runtime-env agent) listens on 127.0.0.1 only.

    Ray binds its servers to the node address, and takes the machine's outward
    address as the node address unless its single-machine mode is on (the
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` setting, read once when Ray is imported;
    an explicit ``_node_ip_address="127.0.0.1"`` is turned back into the outward
    address). The value Ray read is set here, for this process only: the processes
    the instance starts are handed the node address, and a ``ray start`` run later
    from this process keeps Ray's usual behaviour. ``tests/test_ray_loopback.py``
    checks every listening socket of a started instance.
    """
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def _filter_raylet_notices() -> None:
    """Keep the raylet's notices that :mod:`crawl2chat.infra.console` counts as chatter
    off the terminal (unless verbose).

    A Ray driver prints what the cluster publishes to it (its error channel: the
    raylet's warnings, a worker's crash) on stdout from a thread of its own, so the
    line-by-line filter sits in front of that printer. What it holds back is still in
    the raylet's log (``raylet.out`` of the session's logs folder); everything else,
    errors included, is printed as before.
    """
    from ray._private import worker as ray_worker

    from crawl2chat.infra.console import is_chatter

    printer = getattr(ray_worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "filters_chatter", False):
        return

    def print_to_stdstream(data: dict, ignore_prefix: bool) -> None:
        lines = data.get("lines") or []
        kept = [line for line in lines if not is_chatter(str(line))]
        for line in lines:
            if line not in kept:
                log.info("ray (%s): %s", data.get("pid"), line)
        if kept or not lines:
            printer({**data, "lines": kept}, ignore_prefix)

    print_to_stdstream.filters_chatter = True
    ray_worker.print_to_stdstream = print_to_stdstream


def _no_auto_connect() -> None:
    """This process connects to Ray through :func:`ensure_ray` only: Ray's own
    connect-on-first-use is turned off. Without it, a thread still running when
    Ray shuts down (Ray Data's scheduling thread, as a stopped command exits and
    Ray's exit hook has run) starts a second local instance on its next call,
    with a warning on the terminal after the command's last line; with it, that
    call fails in its thread and the process ends."""
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False


def _check_token(address: str) -> None:
    """Raise :class:`ServiceUnreachable` when a cluster with token authentication refuses
    this process's token (none set, or another cluster's): one GCS call, under a second.
    ``ray.init`` retries the refused call for about 45 s, a C++ warning on the terminal
    each second, then fails with a message that names no token."""
    if address.startswith("ray://") or host_port(address) is None:
        return  # a Ray Client connection, or "auto": ray.init finds the cluster and says the rest
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError

    try:
        GcsClient(address=address)
    except AuthenticationError as e:
        raise ServiceUnreachable(
            f"The Ray cluster at {address} (RAY_ADDRESS) refused this command's token: set RAY_AUTH_TOKEN "
            f"(or RAY_AUTH_TOKEN_PATH) to the cluster's token, as its nodes have it.") from e
    except Exception:  # noqa: BLE001 - anything else is ray.init's to say
        pass


def ensure_ray(num_cpus: int | None = None) -> dict:
    """Initialise Ray once per process and return a short description of it."""
    if not ray.is_initialized():
        from crawl2chat.infra.console import quiet_libraries

        # Whatever started this process (the command, a Prefect worker's flow run):
        # Ray's start-up notices go to its logs, not the terminal.
        quiet_libraries()
        _filter_raylet_notices()
        address = os.environ.get("RAY_ADDRESS") or None
        kwargs: dict = {"ignore_reinit_error": True, "log_to_driver": False, "logging_level": logging.WARNING}
        if address:
            kwargs["address"] = address
        else:
            # "local": a new instance, never a cluster some earlier `ray start` left on this machine.
            kwargs.update(address="local", include_dashboard=False, num_cpus=num_cpus)
            _loopback_only()
            # Ray's agents outlive a raylet that died with this process by a minute (they
            # report its death to the GCS, gone too, and wait out the call): a lifeline
            # (stages.lifetime) reaps them the moment this process ends, whoever started it
            # (the command holds one already; a Prefect worker's flow run or a notebook does not).
            hold_lifeline()
            # The local instance lives and dies with this process: Ray binds its GCS and
            # raylet to it (a parent-death signal); the raylet's agents are told of the
            # raylet's death through a pipe instead of noticing it by polling.
            os.environ.setdefault("RAY_enable_pipe_based_agent_to_parent_health_check", "1")
        if address:
            require("Ray cluster", address, "RAY_ADDRESS")
            _check_token(address)
        # ray.init puts in its own SIGTERM handler (sys.exit): the command's, which closes its
        # runs and says it stopped, is put back.
        on_term = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
        try:
            ray.init(**kwargs)
        except ConnectionError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ServiceUnreachable(f"The Ray cluster at {address} (RAY_ADDRESS) could not be joined: {first}") from e
        finally:
            if on_term is not None:
                signal.signal(signal.SIGTERM, on_term)
        ensure_ray.started_local = not address
        _no_auto_connect()
        if address and not address.startswith("ray://"):
            # A head that dies mid-job: Ray's core waits a minute for it, then ends this
            # process from C++ with its own message and the runs left open. (A Ray Client
            # connection, ray://, raises in Python once its own reconnection gives up.)
            # Said before Ray's own exit, and no sooner than that allows: a head whose GCS
            # restarts (GCS fault tolerance) within Ray's reconnection timeout is waited for.
            reconnect_s = float(os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s", "60"))
            watch("Ray cluster", ray.get_runtime_context().gcs_address, "RAY_ADDRESS", shown=address,
                  active=ray.is_initialized, lost_after_s=max(5.0, reconnect_s - UNWIND_S - 5.0))
        # Progress bars from many concurrent steps drown the per-step lines we print.
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        # Each step prints one line of its own; Ray Data's per-dataset INFO lines go to its log files.
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        # Ray's and Ray Data's notices stay in their log files (ray-data.log), off the terminal.
        from crawl2chat.infra.console import filter_terminal_handlers

        for name in ("ray", "ray.data"):
            filter_terminal_handlers(name)
        # Dedup's groupbys use the sort-based shuffle: Ray's hash shuffle starts
        # aggregator actors for every groupby (seconds each on a small machine), and
        # its reducers fail on dedup's union of rows with different schemas.
        ctx.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
        log.info("Ray connected: %s", address or "local")
    resources = ray.cluster_resources()
    if not getattr(ensure_ray, "_announced", False) and os.environ.get("RAY_ADDRESS"):
        nodes = len([n for n in ray.nodes() if n.get("Alive")])
        print(f"[ray] connected to {os.environ['RAY_ADDRESS']}: {nodes} nodes, {resources.get('CPU', 0):g} CPUs",
              flush=True)
        ensure_ray._announced = True
    return {
        "address": os.environ.get("RAY_ADDRESS") or "local",
        "cpus": resources.get("CPU", 0),
        "nodes": len([n for n in ray.nodes() if n.get("Alive")]),
    }


def release_local_ray() -> bool:
    """Stop the local instance :func:`ensure_ray` started in this process, if one is
    running (a cluster connection is left alone); the next :func:`ensure_ray` starts it
    again. Training calls this once its data is prepared: an idle local Ray (log
    monitor, idle workers, Ray Data's stats actors) takes about a tenth of a core,
    which a 2-core machine's training processes would otherwise give up. Returns
    whether an instance was stopped."""
    if not (ray.is_initialized() and getattr(ensure_ray, "started_local", False)):
        return False
    ray.shutdown()
    ensure_ray.started_local = False
    log.info("local Ray stopped: training has the cores")
    return True
