"""A corrupt weights file is a DataError naming the folder and the fix (one line from the CLI), not a
traceback."""

from __future__ import annotations

import pytest

from ccft.core.errors import DataError
from ccft.core.models import load_base
from conftest import make_tiny_folder


def test_corrupt_safetensors_is_a_data_error(tmp_path, tokenizer):
    folder = make_tiny_folder(tmp_path / "base", tokenizer)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file" * 10)
    with pytest.raises(DataError, match=r"model weights cannot be read .*corrupt or truncated"):
        load_base(str(folder))


def test_cli_train_on_corrupt_weights_is_one_line(tmp_path, tokenizer, capsys):
    from ccft.cli.main import main

    folder = make_tiny_folder(tmp_path / "base", tokenizer)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"base: {folder}\ntrain_data: gsm8k:train\ntrain_rows: 2\nmax_steps: 1\nuse_cpu: true\n"
        f"output_dir: {tmp_path / 'out'}\nreport_to: none\n"
    )
    assert main(["train", str(recipe)]) == 2
    err = [
        x for x in capsys.readouterr().err.strip().splitlines() if x.startswith("ccft")
    ]  # not library warnings
    assert len(err) == 1 and err[0].startswith("ccft train: error:") and "corrupt or truncated" in err[0]


def test_embedded_name_in_other_case_is_a_config_error_not_a_hub_lookup(tmp_path, monkeypatch):
    """``SmolLM2-135M-Instruct`` (not a folder here) names the embedded model in other letter case: a
    ConfigError with the right name, before transformers would try the Hub."""
    from ccft.core.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="use 'smollm2-135m-instruct'"):
        load_base("SmolLM2-135M-Instruct")
