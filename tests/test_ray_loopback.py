"""The local Ray instance the data stage starts listens on the loopback address only."""

from __future__ import annotations

import ipaddress
import time

import psutil


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def _listeners(pids: set[int]) -> list[tuple[str, str, int]]:
    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            try:
                name = psutil.Process(conn.pid).name()
            except psutil.NoSuchProcess:
                continue
            found.append((name, conn.laddr.ip, conn.laddr.port))
    return found


def test_every_listening_socket_of_local_ray_is_on_loopback(ray_local):
    import ray

    assert ray_local["address"] == "local"
    assert ray.get(ray.remote(lambda: 1).remote()) == 1  # a worker process is up too
    me = psutil.Process()
    deadline, listeners = time.time() + 30, []
    while time.time() < deadline:  # the agents start a moment after the raylet
        pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
        listeners = _listeners(pids)
        names = {name for name, _, _ in listeners}
        if {"gcs_server", "raylet"} <= names and any("RuntimeEnvAgent" in n for n in names):
            break
        time.sleep(0.5)
    names = {name for name, _, _ in listeners}
    assert {"gcs_server", "raylet"} <= names, listeners
    outward = [entry for entry in listeners if not _loopback(entry[1])]
    assert not outward, f"Ray listens beyond loopback: {outward}"
    assert all(n["NodeManagerAddress"] == "127.0.0.1" for n in ray.nodes())
