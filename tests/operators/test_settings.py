"""The control plane's settings: one typed, bounded object read from TG_* variables, errors in one line."""

from __future__ import annotations

import pytest

from trainguard.operators.settings import ControlSettings, SettingsError


def test_settings_come_typed_from_a_mapping_and_overrides_win():
    s = ControlSettings.from_env({"TG_DIAG_CONCURRENCY": "4", "TG_SLOW_FACTOR": "1.5", "TG_DRY_RUN": "yes",
                                  "TG_RESUME_TIMEOUT_S": "", "TG_UNRELATED": "x"})
    assert (s.diag_concurrency, s.slow_factor, s.dry_run, s.resume_timeout_s) == (4, 1.5, True, 300.0)
    overridden = ControlSettings.from_env({"TG_DIAG_CONCURRENCY": "4"}, diag_concurrency=6, dry_run=None)
    assert overridden.diag_concurrency == 6
    assert ControlSettings.from_env({}) == ControlSettings()


def test_settings_come_from_the_process_environment_through_pydantic_settings(monkeypatch):
    monkeypatch.setenv("TG_RESTART_ATTEMPTS", "5")
    monkeypatch.setenv("TG_LAZY_FORCE_S", "60")
    s = ControlSettings.from_env()
    assert s.restart_attempts == 5 and s.lazy_force_s == 60.0 and s.known_good_steps == 200


@pytest.mark.parametrize("var,value,message", [
    ("TG_DIAG_CONCURRENCY", "many", "TG_DIAG_CONCURRENCY='many' is not a whole number; unset it for the default (8)"),
    ("TG_DIAG_CONCURRENCY", "1", "TG_DIAG_CONCURRENCY=1 is below 2; unset it for the default (8)"),
    ("TG_BREAKER_SHARE", "2", "TG_BREAKER_SHARE=2 is above 1.0; unset it for the default (0.5)"),
    ("TG_SLOW_FACTOR", "fast", "TG_SLOW_FACTOR='fast' is not a number; unset it for the default (1.25)"),
    ("TG_DRY_RUN", "maybe", "TG_DRY_RUN='maybe' is not true or false; unset it for the default (False)"),
    ("TG_AGENT_SILENT_S", "2", "TG_AGENT_SILENT_S=2 must be 0 (off) or at least 5 s (agents beat every 2 s); "
                               "unset it for the default (15.0)"),
])
def test_a_bad_value_is_one_line_naming_the_variable_and_exit_2(var, value, message, monkeypatch):
    with pytest.raises(SettingsError) as mapping:
        ControlSettings.from_env({var: value})
    assert str(mapping.value) == message and mapping.value.exit_code == 2
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError) as environ:
        ControlSettings.from_env()
    assert str(environ.value) == message
