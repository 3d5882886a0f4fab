"""The SSH transport's key loading (the live connections are tests/e2e/test_node_hook.py's, against real sshd)."""

from __future__ import annotations

import io

import paramiko
import pytest

from trainguard.node_tools.transport import private_key


@pytest.mark.parametrize("kind", ["rsa", "ecdsa"])
def test_a_private_keys_text_loads_whatever_its_type(kind: str):
    made = paramiko.RSAKey.generate(2048) if kind == "rsa" else paramiko.ECDSAKey.generate()
    out = io.StringIO()
    made.write_private_key(out)
    loaded = private_key(out.getvalue())
    assert type(loaded) is type(made) and loaded.asbytes() == made.asbytes()


def test_an_openssh_ed25519_keys_text_loads(tmp_path):
    import subprocess

    path = tmp_path / "k"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    loaded = private_key(path.read_text())
    assert isinstance(loaded, paramiko.Ed25519Key)
    assert loaded.get_base64() == (tmp_path / "k.pub").read_text().split()[1]


def test_text_that_is_no_key_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match=r"private_key extra .* paste the whole key file"):
        private_key("-----BEGIN NOTHING-----\nxx\n-----END NOTHING-----\n")
