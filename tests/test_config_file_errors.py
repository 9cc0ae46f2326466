"""A bad value in a config file is one line that names the file, before any model loads: the config's own checks
(config field '...') and a dataset's options (dataset_config, eval_dataset_config), whichever catches it; a value
given on the command line is not blamed on the file."""

import pytest
from cli_runs import one_line


def _config(tmp_path, model, *lines):
    f = tmp_path / "run.yaml"
    f.write_text("\n".join([f"model_name_or_path: {model}", "dataset_name: arithmetic", "max_steps: 1", *lines]) + "\n")
    return f


def test_a_field_the_config_refuses_names_the_file(cli, tmp_path, model, no_model_load):
    f = _config(tmp_path, model, "learning_rate: -1.0")
    rc, _, err = cli("train", f, "--output_dir", tmp_path / "run", "--device", "cpu")
    assert rc == 2 and f"{f}: config field 'learning_rate'" in err and one_line(err)


@pytest.mark.parametrize("field", ["dataset_config", "eval_dataset_config"])
def test_a_dataset_option_from_the_file_names_the_file_and_the_field(cli, tmp_path, model, no_model_load, field):
    extra = ["eval_dataset_name: arithmetic", "eval_on_start: true"] if field.startswith("eval") else []
    f = _config(tmp_path, model, f"{field}: {{sizee: 20}}", *extra)
    rc, _, err = cli("train", f, "--output_dir", tmp_path / "run", "--device", "cpu")
    assert rc == 2 and f"{f}: {field}" in err and "did you mean 'size'" in err and one_line(err)


def test_a_dataset_option_from_the_command_line_does_not_blame_the_file(cli, tmp_path, model, no_model_load):
    f = _config(tmp_path, model)
    rc, _, err = cli("train", f, "--output_dir", tmp_path / "run", "--device", "cpu", "--dataset_config", "{sizee: 3}")
    assert rc == 2 and "dataset_config: unknown option 'sizee'" in err and str(f) not in err and one_line(err)
