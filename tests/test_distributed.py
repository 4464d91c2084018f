"""titan_lite.distributed: the NCCL flight-recorder environment set from [comm]."""

import os

import pytest

from titan_lite.config.schema import Comm
from titan_lite.distributed import configure_flight_recorder, remove_empty_trace_folder

FR_VARIABLES = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


@pytest.fixture
def clean_env(monkeypatch):
    """No flight-recorder variable set, and whatever the test sets undone afterwards."""
    for name in FR_VARIABLES:
        monkeypatch.setenv(name, "")  # recorded, so monkeypatch restores (or removes) it at teardown
        monkeypatch.delenv(name)
    return monkeypatch


def test_flight_recorder_variables_and_folder(clean_env, tmp_path):
    comm = Comm(trace_buf_size=500, save_traces_folder="fr", save_traces_file_prefix="r_")
    configure_flight_recorder(comm, str(tmp_path), "nccl")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "500"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "fr" / "r_")
    assert (tmp_path / "fr").is_dir()
    remove_empty_trace_folder(comm, str(tmp_path))  # the end of a run that dumped nothing
    assert not (tmp_path / "fr").exists()


def test_no_trace_folder_where_nothing_can_be_dumped(clean_env, tmp_path):
    """gloo (every CPU run) has no flight recorder: its run folder gets no empty comm_traces/."""
    configure_flight_recorder(Comm(), str(tmp_path), "gloo")
    assert not (tmp_path / "comm_traces").exists()
    (tmp_path / "comm_traces").mkdir()
    (tmp_path / "comm_traces" / "rank_0").write_text("dump")
    remove_empty_trace_folder(Comm(), str(tmp_path))  # a dump stays
    assert (tmp_path / "comm_traces" / "rank_0").is_file()


def test_zero_buffer_disables_recording_and_dumps(clean_env, tmp_path):
    configure_flight_recorder(Comm(trace_buf_size=0), str(tmp_path), "nccl")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "0"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ and "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
    assert not (tmp_path / "comm_traces").exists()


def test_user_variables_win(clean_env, tmp_path):
    clean_env.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "7")
    clean_env.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    clean_env.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/elsewhere/trace_")
    configure_flight_recorder(Comm(), str(tmp_path), "nccl")
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert not (tmp_path / "comm_traces").exists()
