"""Settings: precedence of sources, and errors that name the field and the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_plugin.config import Settings, load_settings
from slurm_plugin.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(__import__("os").environ):
        if name.startswith("STRAGGLER_"):
            monkeypatch.delenv(name)


def test_defaults_without_file() -> None:
    """With no file and no environment the documented defaults apply."""
    settings = load_settings(None)
    assert settings.redis.url == "redis://127.0.0.1:6379/0"
    assert settings.slurm.command_timeout_s == 15.0


def test_file_values_are_read(tmp_path: Path) -> None:
    """A TOML file sets values, typed by the schema."""
    path = tmp_path / "config.toml"
    path.write_text('[redis]\nurl = "redis://db.example:6380/2"\n[slurm]\ncommand_timeout_s = 3\n')
    settings = load_settings(path)
    assert settings.redis.url == "redis://db.example:6380/2"
    assert settings.slurm.command_timeout_s == 3.0


def test_typo_in_file_names_the_key_and_the_file(tmp_path: Path) -> None:
    """An unknown key is an error that names both the key and the file."""
    path = tmp_path / "config.toml"
    path.write_text('[redis]\nulr = "redis://x"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert "redis.ulr" in str(info.value)
    assert str(path) in str(info.value)
    assert info.value.field == "redis.ulr"


def test_bad_value_names_the_field(tmp_path: Path) -> None:
    """A value of the wrong type or range names its field."""
    path = tmp_path / "config.toml"
    path.write_text("[slurm]\ncommand_timeout_s = -1\n")
    with pytest.raises(ConfigError, match=r"slurm\.command_timeout_s"):
        load_settings(path)


def test_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    """Broken TOML is reported with the file name, not as a parser traceback."""
    path = tmp_path / "config.toml"
    path.write_text("[redis]\nurl = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(path)


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    """An explicitly named file that does not exist is an error, not silently ignored."""
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "nope.toml")


def test_environment_beats_file_and_file_path_from_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STRAGGLER_CONFIG selects the file; STRAGGLER_* variables override its values."""
    path = tmp_path / "config.toml"
    path.write_text('[redis]\nurl = "redis://from-file:1/0"\n[slurm]\ncommand_timeout_s = 4\n')
    monkeypatch.setenv("STRAGGLER_CONFIG", str(path))
    monkeypatch.setenv("STRAGGLER_REDIS_URL", "redis://from-env:2/0")
    settings = load_settings()
    assert settings.redis.url == "redis://from-env:2/0"
    assert settings.slurm.command_timeout_s == 4.0


def test_bad_environment_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad value from the environment names the variable rather than a file."""
    monkeypatch.setenv("STRAGGLER_SLURM_COMMAND_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="STRAGGLER_SLURM_COMMAND_TIMEOUT_S"):
        load_settings(None)


def test_settings_are_frozen() -> None:
    """Settings are one immutable object shared by everything an entry point builds."""
    settings = Settings()
    with pytest.raises(ValueError, match="frozen"):
        settings.redis.url = "redis://other"  # type: ignore[misc]


def test_slurm_command_and_env(tmp_path: Path) -> None:
    """Slurm binaries honour slurm_bin_dir and the environment carries SLURM_CONF."""
    settings = Settings(slurm={"bin_dir": tmp_path, "conf": tmp_path / "slurm.conf"})
    assert settings.slurm_command("scontrol") == str(tmp_path / "scontrol")
    assert settings.slurm_env()["SLURM_CONF"] == str(tmp_path / "slurm.conf")
    assert Settings().slurm_command("squeue") == "squeue"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
@pytest.mark.parametrize(
    "url", ["redis://admin:s3cret@db:6379/0", "redis://db:6379/0?db=1&password=s3cret"]
)
def test_file_with_a_password_must_be_private(tmp_path: Path, mode: int, url: str) -> None:
    """Admin credentials in a file others can read or change are refused, naming the mode; a
    password in the URL's query counts as much as one in its userinfo."""
    path = tmp_path / "config.toml"
    path.write_text(f'[redis]\nurl = "{url}"\n')
    path.chmod(mode)
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert f"{mode:04o}" in str(info.value)
    assert str(path) in str(info.value)
    assert "s3cret" not in str(info.value)
    path.chmod(0o600)
    assert load_settings(path).redis.url == url


def test_file_without_a_password_may_be_world_readable(tmp_path: Path) -> None:
    """Non-secret settings (no password in the URL) stay readable by the job's ranks."""
    path = tmp_path / "config.toml"
    path.write_text('[redis]\nurl = "rediss://db:6380/0"\ntls_ca_file = "/etc/ca.pem"\n')
    path.chmod(0o644)
    settings = load_settings(path)
    assert settings.redis.tls_ca_file == Path("/etc/ca.pem")


def test_redact_url_hides_only_the_password() -> None:
    """Passwords never reach output; the rest of the URL stays readable."""
    from slurm_plugin.config import redact_url  # noqa: PLC0415

    assert redact_url("rediss://admin:s3cr@t@db:6380/0") == "rediss://admin:***@db:6380/0"
    assert redact_url("redis://:pw@db:6379/0") == "redis://:***@db:6379/0"
    assert redact_url("redis://user@db:6379/0") == "redis://user@db:6379/0"
    assert redact_url("redis://db:6379/0") == "redis://db:6379/0"
    assert redact_url("redis://db/0?db=2&password=s3cret&socket_timeout=3") == (
        "redis://db/0?db=2&password=***&socket_timeout=3"
    )
    assert redact_url("redis://u:pw@db/0?Pass%77ord=x") == "redis://u:***@db/0?Pass%77ord=***"


def test_config_show_never_prints_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    """`straggler config show` (table and JSON) redacts the admin password."""
    from click.testing import CliRunner  # noqa: PLC0415

    from slurm_plugin.cli.main import cli  # noqa: PLC0415

    for url, shown in (
        ("redis://admin:s3cret@db:6379/0", "admin:***@db"),
        ("redis://db:6379/0?password=s3cret", "password=***"),
    ):
        monkeypatch.setenv("STRAGGLER_REDIS_URL", url)
        for args in (["config", "show"], ["config", "show", "--json"]):
            result = CliRunner().invoke(cli, args)
            assert result.exit_code == 0, result.output
            assert "s3cret" not in result.output
            assert shown in result.output


def test_the_settings_file_is_validated_whole_whatever_the_environment_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25: an invalid value in the file went unreported while an environment variable
    set the same key (and came back the day that variable went)."""
    path = tmp_path / "config.toml"
    path.write_text("[service]\ninterval_s = -1\n")
    monkeypatch.setenv("STRAGGLER_SERVICE_INTERVAL_S", "2")
    with pytest.raises(ConfigError, match=r"service\.interval_s: Input should be greater than 0"):
        load_settings(path)
    path.write_text("[service]\ninterval_s = 3\n")
    assert load_settings(path).service.interval_s == 2  # the environment still wins


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("redis://127.0.0.1:6379/0", True),
        ("redis://127.0.0.1:6379", True),
        ("redis://127.0.0.1:6379/3", False),
        ("rediss://svc:pw@redis.example:6380/0?db=2", False),
    ],
)
def test_job_credentials_need_database_zero(url: str, ok: bool, tmp_path: Path) -> None:
    """Issue 25: with job_credentials a redis_url on another database stopped all telemetry
    (a job's user may not SELECT); serve and the prolog now refuse such settings at start."""
    path = tmp_path / "config.toml"
    path.write_text(f'[telemetry]\njob_credentials = true\n[redis]\nurl = "{url}"\n')
    path.chmod(0o600)
    if ok:
        assert load_settings(path).telemetry.job_credentials
        return
    with pytest.raises(
        ConfigError, match=r"telemetry\.job_credentials needs redis\.url on database 0"
    ) as info:
        load_settings(path)
    assert "\n" not in str(info.value)
    assert "Value error" not in str(info.value)


def test_the_flat_names_of_0_1_still_work_for_one_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 0.1 settings file (flat names) and 0.1 variable names load as before, and each old
    name is logged once with the one that replaces it; the new form wins where both are given,
    and the environment still beats the file."""
    path = tmp_path / "config.toml"
    path.write_text(
        'redis_url = "redis://old:1/0"\npolicy_dir = "/srv/policies"\ncommand_timeout_s = 7\n'
        "health_expected_gpus = 4\nservice_interval_s = 5\n[slurm]\ncommand_timeout_s = 9\n"
    )
    monkeypatch.setenv("STRAGGLER_DEFAULT_POLICY", "evict")  # 0.1's name of service.default_policy
    settings = load_settings(path)
    assert settings.redis.url == "redis://old:1/0"
    assert settings.service.policy_dir == Path("/srv/policies")
    assert settings.health.expected_gpus == 4
    assert settings.service.interval_s == 5
    assert settings.slurm.command_timeout_s == 9  # the [slurm] table is the new form: it wins
    assert settings.service.default_policy == "evict"
    logged = capsys.readouterr()
    text = logged.out + logged.err
    for old, new in (
        ("policy_dir", "[service] policy_dir"),
        ("default_policy", "[service] default_policy"),
    ):
        assert old in text
        assert new in text
    assert "STRAGGLER_DEFAULT_POLICY" in text
    monkeypatch.setenv("STRAGGLER_SERVICE_POLICY_DIR", "/from/env")
    assert load_settings(path).service.policy_dir == Path("/from/env")


def test_a_flat_name_given_in_code_warns(tmp_path: Path) -> None:
    """Code that builds Settings with a 0.1 name works, with a DeprecationWarning."""
    with pytest.warns(DeprecationWarning, match=r"redis_url is now \[redis\] url"):
        assert Settings(redis_url="redis://x:1/0").redis.url == "redis://x:1/0"  # type: ignore[call-arg]


def test_development_settings_are_not_production_settings(tmp_path: Path) -> None:
    """The dev cluster's knobs (fake GPUs above all) are refused in a settings file, naming
    the variable the dev cluster reads instead."""
    path = tmp_path / "config.toml"
    path.write_text(f'devcluster_fake_nvml = "{tmp_path / "gpus.json"}"\n')
    with pytest.raises(ConfigError, match="STRAGGLER_DEVCLUSTER_FAKE_NVML"):
        load_settings(path)
    assert "devcluster" not in " ".join(Settings.model_fields)


def test_every_field_has_one_environment_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """STRAGGLER_<TABLE>_<NAME> sets every field of every table."""
    monkeypatch.setenv("STRAGGLER_HEALTH_CRITICAL_XIDS", "[79]")
    monkeypatch.setenv("STRAGGLER_TELEMETRY_JOB_CREDENTIALS_DIR", "/run/x")
    monkeypatch.setenv("STRAGGLER_SAFETY_MAX_EVICTIONS_PER_HOUR", "4")
    settings = load_settings(None)
    assert settings.health.critical_xids == [79]
    assert settings.telemetry.job_credentials_dir == Path("/run/x")
    assert settings.safety.max_evictions_per_hour == 4


def test_a_password_in_either_form_makes_the_file_private(tmp_path: Path) -> None:
    """A file with a [redis] table and 0.1's flat redis_url beside it: the password in the
    flat one still makes a readable file an error."""
    path = tmp_path / "config.toml"
    path.write_text('redis_url = "redis://admin:s3cret@db:6379/0"\n[redis]\ntimeout_s = 3\n')
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="0644"):
        load_settings(path)


@pytest.mark.parametrize("char", ["?", "#", "/"])
def test_a_password_with_a_raw_url_delimiter_is_refused_and_never_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, char: str
) -> None:
    """Issue 38, item 9: a password with a raw ``?``, ``#`` or ``/`` (the URL parser ends the
    host there) was printed by `config show` and `status`, and a world-readable file holding
    it passed the privacy check. Now such a file is private or refused, the URL is refused
    with how to write it, and no output shows the password."""
    from click.testing import CliRunner  # noqa: PLC0415

    from slurm_plugin.cli.main import cli  # noqa: PLC0415
    from slurm_plugin.config import redact_url  # noqa: PLC0415

    url = f"redis://admin:ab{char}cd3f@db:6379/0"
    assert redact_url(url) == "redis://admin:***@db:6379/0"
    path = tmp_path / "config.toml"
    path.write_text(f'[redis]\nurl = "{url}"\n')
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="0644") as info:
        load_settings(path)
    assert "cd3f" not in str(info.value)
    path.chmod(0o600)
    with pytest.raises(ConfigError, match=r"redis\.url: the password holds a raw") as info:
        load_settings(path)
    assert "cd3f" not in str(info.value)
    assert "%3F, %23, %2F" in str(info.value)
    monkeypatch.setenv("STRAGGLER_REDIS_URL", url)
    for args in (["config", "show"], ["status"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code != 0
        assert "cd3f" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
    # An "@" in a query value is not a userinfo: such a URL still loads.
    monkeypatch.setenv("STRAGGLER_REDIS_URL", "redis://db:6379/0?password=a@b")
    assert load_settings(None).redis.url.endswith("a@b")


def test_the_metrics_address_must_be_an_ip_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 38, item 9: the metrics endpoint's address is a setting, loopback by default."""
    assert load_settings(None).service.metrics_address == "127.0.0.1"
    monkeypatch.setenv("STRAGGLER_SERVICE_METRICS_ADDRESS", "0.0.0.0")  # noqa: S104
    assert load_settings(None).service.metrics_address == "0.0.0.0"  # noqa: S104
    monkeypatch.setenv("STRAGGLER_SERVICE_METRICS_ADDRESS", "everywhere")
    with pytest.raises(ConfigError, match=r"service\.metrics_address: 'everywhere' is not an IP"):
        load_settings(None)


def test_an_invalid_flat_value_beside_its_table_value_is_an_error(tmp_path: Path) -> None:
    """Issue 38, item 9: ``command_timeout_s = -1`` (0.1's flat name) beside a valid
    ``[slurm] command_timeout_s`` was accepted in silence; a valid one still loses quietly."""
    path = tmp_path / "config.toml"
    path.write_text("command_timeout_s = -1\n[slurm]\ncommand_timeout_s = 9\n")
    with pytest.raises(ConfigError, match=r"command_timeout_s \(key in .*greater than 0"):
        load_settings(path)
    path.write_text("command_timeout_s = 7\n[slurm]\ncommand_timeout_s = 9\n")
    assert load_settings(path).slurm.command_timeout_s == 9
