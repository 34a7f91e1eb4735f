"""Context parallelism across two hosts: ``torchrun --nnodes 2 --nproc-per-node 2`` where each node runs
in its own network namespace, the two joined by a veth pair (10.77.0.1 and 10.77.0.2, addresses that
exist only inside the namespaces made here), gloo over TCP on that link. Skipped, saying why, where
network namespaces cannot be made (not root, no ``ip``, no CAP_NET_ADMIN)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

ADDR = ("10.77.0.1", "10.77.0.2")


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2): cannot make network namespaces")
    tag = f"ak{os.getpid() % 100000}"
    ns = (f"{tag}a", f"{tag}b")
    try:
        _ip("netns", "add", ns[0])
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make a network namespace here (needs root / CAP_SYS_ADMIN): {e.stderr.strip()}")
    try:
        _ip("netns", "add", ns[1])
        _ip("link", "add", f"{tag}v0", "netns", ns[0], "type", "veth", "peer", "name", f"{tag}v1", "netns", ns[1])
        for i in (0, 1):
            _ip("-n", ns[i], "addr", "add", f"{ADDR[i]}/24", "dev", f"{tag}v{i}")
            _ip("-n", ns[i], "link", "set", f"{tag}v{i}", "up")
            _ip("-n", ns[i], "link", "set", "lo", "up")
        yield ns, (f"{tag}v0", f"{tag}v1")
    finally:
        for n in ns:
            _ip("netns", "del", n, check=False)


@pytest.mark.slow
def test_torchrun_two_nodes_over_a_veth_link(two_hosts, tmp_path):
    ns, ifs = two_hosts
    port = "29517"
    procs = []
    for node in (0, 1):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=ifs[node], AK_HOST_IP=ADDR[node], OMP_NUM_THREADS="1",
                   AK_OUT_DIR=str(tmp_path),
                   PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
        cmd = ["ip", "netns", "exec", ns[node], sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "2", "--node-rank", str(node), "--master-addr", ADDR[0], "--master-port", port,
               str(ROOT / "tests" / "_cp_two_host_worker.py")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = "\n".join(outs)
    print(text)
    assert all(p.returncode == 0 for p in procs), text[-3000:]
    ranks = "".join(f.read_text() for f in sorted(tmp_path.glob("rank*.txt")))
    lines = re.findall(r"rank (\d)/4 on (\S+) .*?out err (\S+), grad err (\S+),", ranks)
    assert sorted(int(r) for r, *_ in lines) == [0, 1, 2, 3], text[-3000:]
    assert {ip for _, ip, *_ in lines} == set(ADDR), "ranks on both hosts"
    for _, _, err, gerr in lines:
        assert float(err) <= 2e-5 and float(gerr) <= 2e-5
