"""``import actsave`` (actsave/__init__.py): what a checkout needs before it imports."""
import os
import site
import subprocess
import sys
from pathlib import Path


def test_an_uninstalled_checkout_on_the_path_says_to_install_it():
    # Installing maps actsave.triton_kernels from triton_kernels/; a checkout imported
    # as it is (seen on a lent GPU machine, PYTHONPATH=.) failed deep in codecs.backend.
    # -S skips site's .pth files, an editable install's finder with them; the checkout
    # comes first on the path (before an installed copy), and torch stays importable.
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(root), *site.getsitepackages()])
    done = subprocess.run([sys.executable, "-S", "-c", "import actsave"], capture_output=True, text=True,
                          cwd=root.parent, env={**os.environ, "PYTHONPATH": path}, timeout=300)
    assert done.returncode == 1
    assert "ImportError: actsave was imported from a source checkout that is not installed" in done.stderr
    assert "Run `pip install -e .` in the checkout" in done.stderr
