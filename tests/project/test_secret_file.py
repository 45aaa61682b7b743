"""KVSTORE_SECRET_FILE: the job's secret from a file only its user may read (a mounted
Kubernetes Secret, a file made with umask 077), read by the one reader of the
environment (tracker/control/env.py). A file that is missing, open to group or
others, empty, not a regular file or not text is refused naming it; KVSTORE_SECRET
wins when both are set (what our launchers hand their children), and then the file
is not read at all."""

from __future__ import annotations

import os

import pytest

from kvstore.config import Config
from kvstore.errors import ConfigError
from tracker.control import env

SECRET = "ab" * 32


def secret_file(tmp_path, text=f"{SECRET}\n", mode=0o600, name="secret"):
    path = tmp_path / name
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_the_secret_is_read_from_a_file_only_its_user_may_read(tmp_path, mode):
    path = secret_file(tmp_path, f"  {SECRET}\n", mode)
    settings = env.read({"KVSTORE_SECRET_FILE": path})
    assert (settings.secret, settings.secret_file) == (SECRET, path)    # whitespace stripped
    assert Config.from_env({"KVSTORE_SECRET_FILE": path}).security().token == \
        Config.from_env({"KVSTORE_SECRET": SECRET}).security().token
    assert SECRET not in repr(settings)


def test_a_kubernetes_style_symlinked_secret_is_followed(tmp_path):
    """A mounted Secret's file is a link into a ..data directory: the target is checked."""
    target = secret_file(tmp_path, mode=0o400, name="..data-secret")
    link = tmp_path / "secret"
    link.symlink_to(target)
    assert env.read({"KVSTORE_SECRET_FILE": str(link)}).secret == SECRET


@pytest.mark.parametrize("mode, text, match", [
    (0o644, SECRET, r"group or others may access it \(mode 0644\); .* chmod 600 "),
    (0o640, SECRET, r"group or others may access it \(mode 0640\)"),
    (0o604, SECRET, r"group or others may access it \(mode 0604\)"),
    (0o620, SECRET, r"group or others may access it \(mode 0620\)"),
    (0o600, " \n\t", r": empty"),
    (0o600, "", r": empty"),
])
def test_a_file_open_to_others_or_empty_is_refused_naming_it(tmp_path, mode, text, match):
    path = secret_file(tmp_path, text, mode)
    with pytest.raises(env.EnvError, match=rf"KVSTORE_SECRET_FILE='{path}'{'' if match.startswith(':') else ': '}"
                                           rf"{match}"):
        env.read({"KVSTORE_SECRET_FILE": path})
    with pytest.raises(ConfigError, match="KVSTORE_SECRET_FILE"):     # what kvstore.create raises
        Config.from_env({"KVSTORE_SECRET_FILE": path})


def test_a_missing_file_a_directory_and_binary_data_are_refused_naming_the_file(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(env.EnvError, match=f"KVSTORE_SECRET_FILE='{missing}': no such file"):
        env.read({"KVSTORE_SECRET_FILE": missing})
    folder = tmp_path / "dir"
    folder.mkdir(mode=0o700)
    with pytest.raises(env.EnvError, match=f"KVSTORE_SECRET_FILE='{folder}': not a regular file"):
        env.read({"KVSTORE_SECRET_FILE": str(folder)})
    binary = tmp_path / "bin"
    binary.write_bytes(b"\xff\xfe\x00")
    os.chmod(binary, 0o600)
    with pytest.raises(env.EnvError, match=f"KVSTORE_SECRET_FILE='{binary}': not text"):
        env.read({"KVSTORE_SECRET_FILE": str(binary)})
    huge = secret_file(tmp_path, "x" * (env.SECRET_FILE_BYTES + 1), name="huge")
    with pytest.raises(env.EnvError, match="larger than 65536 bytes"):
        env.read({"KVSTORE_SECRET_FILE": huge})


def test_kvstore_secret_wins_and_the_file_is_then_not_read(tmp_path):
    """Our launchers hand every child KVSTORE_SECRET; a KVSTORE_SECRET_FILE the user
    exported travels along and may not exist where the child runs (another host)."""
    settings = env.read({"KVSTORE_SECRET": "cd" * 32, "KVSTORE_SECRET_FILE": str(tmp_path / "elsewhere")})
    assert settings.secret == "cd" * 32
    assert env.read({}).secret is None and env.read({"KVSTORE_SECRET_FILE": ""}).secret is None


def test_a_fifo_is_refused_at_once_instead_of_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(env.EnvError, match=f"KVSTORE_SECRET_FILE='{fifo}': not a regular file"):
        env.read({"KVSTORE_SECRET_FILE": str(fifo)})
