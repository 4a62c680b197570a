"""The GPU is used: the learner's and local nodes' `--device auto|cpu|cuda` (auto: cuda when torch sees a GPU),
`--dtype auto` following the learner's device, and `cuda` on a machine without CUDA refused in one line.

There is no GPU here: the choices are pure functions tested against their tables, torch's CUDA answers are
monkeypatched, and the CPU path runs end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hub.cli.local_nodes import join_argv, local_nodes_device
from hub.config import HubConfig
from shared.checks import UserError
from shared.layout import HUB_LOG_FILE
from shared.precision import device_phrase, pick_device, pick_dtype, resolve_device, resolve_dtype
from testbed.harness import start_hub
from tests.test_first_contact import assert_one_line_mistake, run, snapshot_of


@pytest.mark.parametrize(
    ("choice", "cuda", "device"),
    [("auto", True, "cuda"), ("auto", False, "cpu"), ("cpu", True, "cpu"), ("cpu", False, "cpu"), ("cuda", True, "cuda")],
)
def test_the_device_choice(choice: str, cuda: bool, device: str) -> None:
    assert pick_device(choice, cuda) == device


@pytest.mark.parametrize(
    ("choice", "device", "bf16", "dtype"),
    [
        ("auto", "cuda", True, "bfloat16"),
        ("auto", "cuda:1", True, "bfloat16"),
        ("auto", "cuda", False, "float32"),
        ("auto", "cpu", False, "float32"),
        ("auto", "cpu", True, "float32"),
        ("float32", "cuda", True, "float32"),
        ("bfloat16", "cpu", False, "bfloat16"),
    ],
)
def test_the_dtype_choice_follows_the_device(choice: str, device: str, bf16: bool, dtype: str) -> None:
    assert pick_dtype(choice, device, bf16) == dtype


@pytest.mark.parametrize(
    ("choice", "learner", "device"),
    [("auto", "cuda", "cuda"), ("auto", "cpu", "cpu"), ("cpu", "cuda", "cpu"), ("cuda", "cpu", "cuda")],
)
def test_local_nodes_follow_the_learner_unless_told(choice: str, learner: str, device: str) -> None:
    assert local_nodes_device(choice, learner) == device


@pytest.mark.parametrize(
    ("device", "cuda", "phrase"),
    [("cuda", True, "cuda:0 (GPU-X)"), ("cpu", False, "cpu (no CUDA)"), ("cpu", True, "cpu (--device cpu; CUDA is here)")],
)
def test_the_start_line_says_where_the_learner_runs(device: str, cuda: bool, phrase: str) -> None:
    assert device_phrase(device, cuda, "GPU-X") == phrase


@pytest.fixture
def a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch as it answers on a machine with a bf16-capable CUDA GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def test_a_default_hub_on_a_gpu_machine_learns_on_it_and_publishes_bf16(a_gpu) -> None:
    """GPU volunteers pick bf16 at join (auto): the hub's default must publish bf16 there, not float32."""
    lc = HubConfig().learner
    assert resolve_device(lc.device, "--device") == "cuda"
    assert resolve_dtype(lc.dtype, lc.device) == "bfloat16"
    assert resolve_dtype("auto", None) == "bfloat16"  # a node's unset device: the same answer


def test_the_hub_resolves_its_devices_once_at_start(a_gpu) -> None:
    from hub.cli.run import on_this_machine

    config = on_this_machine(HubConfig())
    assert (config.learner.device, config.local_device) == ("cuda", "cuda")
    config = on_this_machine(HubConfig.model_validate({"learner": {"device": "cpu"}}))
    assert (config.learner.device, config.local_device) == ("cpu", "cpu")


def test_auto_on_a_machine_without_cuda_is_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", "--device") == "cpu"
    assert resolve_dtype("auto", "auto") == "float32"
    with pytest.raises(UserError, match=r"^--local-device cuda: torch here has no CUDA \(.+\); use --local-device cpu or auto$"):
        resolve_device("cuda", "--local-device")


def test_the_learner_device_is_a_choice_in_toml_and_on_the_command_line() -> None:
    from shared.config import ConfigError, load_config

    assert HubConfig().learner.device == "auto" and HubConfig().local_device == "auto"
    with pytest.raises(ConfigError, match="device"):
        load_config(HubConfig, None, {"learner.device": "gpu"})
    assert load_config(HubConfig, None, {"learner.device": "cuda:1"}).learner.device == "cuda:1"  # picks a GPU
    help_text = run("hub.cli", "start", "--help").stdout
    assert "--device" in help_text and "--local-device" in help_text


def test_local_nodes_are_given_their_device() -> None:
    argv = join_argv("/ip4/127.0.0.1/tcp/9/p2p/X", 0.35, "cuda", Path("/d"), None, None, ("--dtype", "bfloat16"))
    assert argv[argv.index("--device") + 1] == "cuda" and argv[-2:] == ["--dtype", "bfloat16"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    ("args", "flag"),
    [(["--device", "cuda"], "--device"), (["--local-device", "cuda"], "--local-device"), (["--config", "{toml}"], "--device")],
)
def test_cuda_without_cuda_is_one_line_and_touches_nothing(args: list[str], flag: str, tmp_path: Path) -> None:
    toml = tmp_path / "gpu.toml"
    toml.write_text('[learner]\ndevice = "cuda"\n')
    args = [a.format(toml=toml) for a in args]
    before = snapshot_of(tmp_path)
    line = assert_one_line_mistake(
        run("hub.cli", "start", "--data-dir", str(tmp_path / "data"), "--listen", "/ip4/127.0.0.1/tcp/0", *args),
        f"{flag} cuda: torch here has no CUDA ({torch.__version__})",
        f"use {flag} cpu or auto",
    )
    assert line == f"echo-hub: {flag} cuda: torch here has no CUDA ({torch.__version__}); use {flag} cpu or auto"
    assert snapshot_of(tmp_path) == before


def test_the_node_takes_device_auto() -> None:
    from node.config import NodeConfig

    assert NodeConfig(hub="x", device="auto").device == "auto" and NodeConfig(hub="x").device == "auto"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_default_hub_without_cuda_says_its_learner_is_on_the_cpu(tmp_path: Path) -> None:
    hub = start_hub(tmp_path / "data", "--local-nodes", "0", "--steps", "1")
    try:
        assert "echo-hub: learner on cpu (no CUDA)" in hub.output()
    finally:
        hub.stop()
    assert "learner on cpu (no CUDA)" in (tmp_path / "data" / HUB_LOG_FILE).read_text()


def test_echo_hub_start_help_names_the_device_choices_without_importing_torch() -> None:
    code = (
        "import sys\nfrom hub.cli.main import main\ntry:\n    main(['start', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported for --help'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--device" in result.stdout and "auto" in result.stdout
