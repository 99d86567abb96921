"""The settings model: what the environment may say, the one line a refusal prints, and the
resources that read it once."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from reminders_pipeline.config.settings import Settings, SettingsError
from reminders_pipeline.defs.resources import (
    AlertingResource,
    LedgerResource,
    SenderResource,
    SourcesResource,
    core_settings,
)


@pytest.mark.parametrize(
    ("env", "line"),
    [
        ({"REMINDERS_CLAIM_BATCH_SIZE": "0"}, "REMINDERS_CLAIM_BATCH_SIZE must be at least 1, got 0"),
        ({"REMINDERS_CLAIM_BATCH_SIZE": " 0 "}, "REMINDERS_CLAIM_BATCH_SIZE must be at least 1, got 0"),
        ({"REMINDERS_CHUNK_SIZE": "ten"}, "REMINDERS_CHUNK_SIZE must be a whole number, got 'ten'"),
        ({"REMINDERS_SCHEDULER_SLACK_SECONDS": "-1"}, "REMINDERS_SCHEDULER_SLACK_SECONDS must be at least 0, got -1"),
        ({"REMINDERS_RETENTION_SECONDS": "60"}, "REMINDERS_RETENTION_SECONDS must be at least 3600, got 60"),
        (
            {"REMINDERS_SOURCE_TIMEOUT_SECONDS": "2.5"},
            "REMINDERS_SOURCE_TIMEOUT_SECONDS must be a whole number, got '2.5'",
        ),
        (
            {"REMINDERS_SOURCE_SERIES_SECONDS": "1e-3"},
            "REMINDERS_SOURCE_SERIES_SECONDS must be at least 0.01, got 0.001",
        ),
        (
            {"REMINDERS_SEND_RETRY_BASE_SECONDS": "-1"},
            "REMINDERS_SEND_RETRY_BASE_SECONDS must be at least 0.0, got -1.0",
        ),
        ({"REMINDERS_DISPATCH_POLL_SECONDS": "nan"}, "REMINDERS_DISPATCH_POLL_SECONDS must be at least 0.05, got nan"),
        ({"REMINDERS_DISPATCH_ENABLED": "Yes"}, "REMINDERS_DISPATCH_ENABLED must be 'true' or 'false', got 'Yes'"),
        (
            {"REMINDERS_SOURCE_ALLOW_NETWORKS": "10.0.0.0/8, 10.0.0.0/33"},
            "REMINDERS_SOURCE_ALLOW_NETWORKS: not a network in CIDR notation: '10.0.0.0/33'",
        ),
        (
            {"REMINDERS_BUILD_CRON": "0 0 1 * *"},
            "REMINDERS_BUILD_CRON: cron '0 0 1 * *': day, month and weekday fields must be '*'",
        ),
        ({"REMINDERS_APNS_ENVIRONMENT": "dev"}, "REMINDERS_APNS_ENVIRONMENT must be 'production' or 'sandbox'"),
        (
            {"REMINDERS_INTERRUPTION_LEVEL": "loud"},
            "REMINDERS_INTERRUPTION_LEVEL must be 'passive', 'active', 'time-sensitive' or 'critical'",
        ),
        (
            {"REMINDERS_DAGSTER_EXECUTOR": "threads"},
            "REMINDERS_DAGSTER_EXECUTOR must be 'in_process', 'multiprocess', 'celery' or 'k8s_job'",
        ),
        ({"REMINDERS_CHUNKS_PER_TICK": "17"}, "REMINDERS_CHUNKS_PER_TICK must not exceed REMINDERS_CHUNK_COUNT"),
    ],
)
def test_a_refused_value_is_one_line_naming_the_variable(env, line):
    with pytest.raises(SettingsError) as refused:
        Settings.from_env(env)
    assert str(refused.value) == line


def test_unset_empty_or_blank_means_the_default():
    defaults = Settings()
    assert Settings.from_env({}) == defaults
    blank = {"REMINDERS_CHUNK_COUNT": "  ", "REMINDERS_DISPATCH_ENABLED": " ", "REMINDERS_TOKEN": ""}
    assert Settings.from_env(blank) == defaults
    assert Settings.from_env({"REMINDERS_DISPATCH_POLL_SECONDS": ""}).dispatch_poll_seconds == 2.0


def test_what_each_kind_of_variable_accepts():
    s = Settings.from_env(
        {
            "REMINDERS_DATABASE_URL": "postgres://db.example/reminders",
            "REMINDERS_ENABLED": "True",  # exactly "true" sends; anything else is a dry run
            "REMINDERS_HTTP_ACCEPT_NOW": "true",
            "REMINDERS_DISPATCH_ENABLED": " FALSE ",  # any case, blanks around
            "REMINDERS_SOURCE_TIMEOUT_SECONDS": "3",
            "REMINDERS_SOURCE_PARSE_SECONDS": "0.5",
            "REMINDERS_SOURCE_ALLOW_NETWORKS": "10.0.0.0/8, ,::1",
            "REMINDERS_APNS_ENVIRONMENT": "sandbox",
        }
    )
    assert s.database_url == "postgresql+psycopg://db.example/reminders"
    assert (s.enabled, s.http_accept_now, s.dispatch_enabled) == (False, True, False)
    assert s.source_timeout_seconds == 3.0 and isinstance(s.source_timeout_seconds, float)
    assert s.source_parse_seconds == 0.5
    assert s.source_allow_networks == ("10.0.0.0/8", "::1")
    assert s.apns_environment == "sandbox"


def test_only_capitalised_reminders_variables_count():
    s = Settings.from_env({"reminders_chunk_count": "3", "Reminders_Chunk_Size": "4", "REMINDERS_UNKNOWN": "x"})
    assert (s.chunk_count, s.chunk_size) == (16, 1000)


def test_settings_built_in_code_never_read_the_environment(monkeypatch):
    monkeypatch.setenv("REMINDERS_CHUNK_COUNT", "3")
    assert Settings().chunk_count == 16
    assert Settings(chunk_size=5).chunk_count == 16
    assert Settings.from_env().chunk_count == 3  # from_env reads os.environ by default


def test_settings_are_frozen_and_with_copies_them_unchecked():
    s = Settings()
    with pytest.raises(ValidationError):
        s.chunk_count = 3  # type: ignore[misc]
    shrunk = s.with_(dispatch_run_seconds=5, claim_batch_size=2)  # tests shrink bounds freely
    assert (shrunk.dispatch_run_seconds, shrunk.claim_batch_size, s.claim_batch_size) == (5, 2, 100)
    with pytest.raises(TypeError, match="not a setting: chunks"):
        s.with_(chunks=3)
    assert hash(s) == hash(Settings()) and s != shrunk


def test_resource_fields_override_their_variables_and_are_checked_the_same(monkeypatch):
    monkeypatch.setenv("REMINDERS_ENABLED", "true")
    monkeypatch.setenv("REMINDERS_ALERT_WEBHOOK_URL", "http://127.0.0.1:9/env")
    ledger = LedgerResource(database_url="postgres://db.example/reminders")
    sources = SourcesResource(timeout_seconds=3, per_host=2)
    sender, alerting = SenderResource(enabled="false"), AlertingResource()
    settings = core_settings(ledger, sender, sources, alerting)
    assert settings.database_url == "postgresql+psycopg://db.example/reminders"
    assert settings.enabled is False  # the launchpad's dry run wins over the environment
    assert (settings.source_timeout_seconds, settings.source_per_host, settings.source_concurrency) == (3.0, 2, 32)
    assert settings.alert_webhook_url == "http://127.0.0.1:9/env"  # unset field: the environment stands
    with pytest.raises(SettingsError, match="REMINDERS_SOURCE_PER_HOST must be at least 1, got 0"):
        SourcesResource(per_host=0).settings()
    # A field emptied in the launchpad is the variable emptied: its default (a dry run), never the environment's true.
    assert SenderResource(enabled="").settings().enabled is False


def test_a_resource_reads_the_environment_once(monkeypatch):
    monkeypatch.setenv("REMINDERS_CHUNK_COUNT", "3")
    ledger = LedgerResource()
    assert ledger.settings().chunk_count == 3
    monkeypatch.setenv("REMINDERS_CHUNK_COUNT", "4")
    assert ledger.settings() is ledger.settings() and ledger.settings().chunk_count == 3
    sender = SenderResource(enabled="false")
    assert sender.factory() is sender.factory()


def test_a_renamed_setting_is_still_read_by_its_old_name_with_a_deprecation_line(caplog):
    from reminders_pipeline.config.renamed import _warn_once

    _warn_once.cache_clear()
    with caplog.at_level("WARNING", logger="reminders_pipeline.config.renamed"):
        old = Settings.from_env({"REMINDERS_APNS_HALT_AFTER": "7"})
        again = Settings.from_env({"REMINDERS_APNS_HALT_AFTER": "7"})
    assert old.send_halt_after == again.send_halt_after == 7
    assert caplog.text.count("REMINDERS_APNS_HALT_AFTER is deprecated") == 1  # once per process
    assert "REMINDERS_SEND_HALT_AFTER" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="reminders_pipeline.config.renamed"):
        both = Settings.from_env({"REMINDERS_APNS_HALT_AFTER": "7", "REMINDERS_SEND_HALT_AFTER": "9"})
    assert both.send_halt_after == 9
    assert "ignored" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="reminders_pipeline.config.renamed"):
        assert Settings.from_env({"REMINDERS_SEND_HALT_AFTER": "9"}).send_halt_after == 9
    assert caplog.text == ""


def test_a_bad_value_under_the_old_name_is_refused_naming_the_new_one():
    with pytest.raises(SettingsError, match="REMINDERS_SEND_HALT_AFTER"):
        Settings.from_env({"REMINDERS_APNS_HALT_AFTER": "0"})
