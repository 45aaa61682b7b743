"""The environment contract: parsing, MXNet aliases, errors naming the variable,
and a documentation table that lists every variable."""

import os

import pytest

from kvstore.config import Config
from kvstore.errors import ConfigError
from tracker.control import env

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "configuration.md")


def test_defaults_without_environment():
    c = Config.from_env({})
    assert c.role is None and c.scheduler_port is None
    assert c.timeout == 300.0 and c.heartbeat_timeout == 10.0 and c.chunk_bytes == 2 << 20


def test_gpu_servers_default_to_larger_chunks_unless_the_chunk_size_is_set():
    assert Config.from_env({"KVSTORE_SERVER_DEVICE": "gpu"}).chunk_bytes == env.GPU_SERVER_CHUNK_BYTES == 64 << 20
    assert Config.from_env({"KVSTORE_SERVER_DEVICE": "cpu"}).chunk_bytes == 2 << 20
    assert Config.from_env({"KVSTORE_SERVER_DEVICE": "gpu", "KVSTORE_CHUNK_BYTES": "4096"}).chunk_bytes == 4096


def test_mxnet_aliases_are_read_and_ours_win():
    c = Config.from_env({"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "10.0.0.1",
                         "DMLC_PS_ROOT_PORT": "9091", "DMLC_NUM_WORKER": "4",
                         "DMLC_NUM_SERVER": "2"})
    assert (c.role, c.scheduler_host, c.scheduler_port, c.num_workers, c.num_servers) == \
        ("server", "10.0.0.1", 9091, 4, 2)
    c = Config.from_env({"DMLC_NUM_WORKER": "4", "KVSTORE_NUM_WORKERS": "3"})
    assert c.num_workers == 3


@pytest.mark.parametrize("name, value", [
    ("KVSTORE_NUM_WORKERS", "zero"), ("DMLC_NUM_WORKER", "0"), ("KVSTORE_SCHEDULER_PORT", "70000"),
    ("KVSTORE_TIMEOUT", "-1"), ("DMLC_ROLE", "boss"), ("KVSTORE_RANK", "-2"),
    ("KVSTORE_HEARTBEAT_TIMEOUT", "nan"),
])
def test_invalid_values_name_the_variable(name, value):
    with pytest.raises(ConfigError, match=name):
        Config.from_env({name: value})


def test_launcher_environment_round_trips_through_config():
    child = env.for_process(role="worker", rank=2, scheduler_host="127.0.0.5", scheduler_port=1234,
                            num_workers=3, num_servers=2)
    c = Config.from_env(child)
    assert (c.role, c.rank, c.scheduler_host, c.scheduler_port, c.num_workers, c.num_servers) == \
        ("worker", 2, "127.0.0.5", 1234, 3, 2)
    assert child["DMLC_ROLE"] == "worker"   # scripts written for MXNet see their names too


def test_every_variable_is_documented():
    with open(DOCS) as f:
        text = f.read()
    for var in env.VARIABLES:
        assert f"`{var.name}`" in text, f"{var.name} missing from docs/configuration.md"
        for alias in var.aliases:
            assert alias in text


def test_every_config_field_comes_from_one_variable():
    fields = {f for f in Config.__dataclass_fields__}
    names = {v.name.removeprefix("KVSTORE_").lower() for v in env.VARIABLES}
    assert names <= fields
