"""``attnkit --version``."""

import subprocess
import sys

import attnkit
from attnkit.cli import main


def test_version_flag(capsys):
    try:
        rc = main(["--version"])
    except SystemExit as e:
        rc = e.code
    assert rc == 0
    assert capsys.readouterr().out.strip() == f"attnkit {attnkit.__version__}"


def test_version_flag_as_module():
    r = subprocess.run([sys.executable, "-m", "attnkit", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"attnkit {attnkit.__version__}"
