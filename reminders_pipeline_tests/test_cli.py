"""The CLI a newcomer follows in the README, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from reminders_pipeline.cli import main
from reminders_pipeline.dev.demo import dev_environment
from reminders_pipeline.domain.rules import DEFAULT_ALL_DAY_RULES
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database

from .support import NOW, NOW_S, TOKEN, at, item


@pytest.fixture
def cli(db_url):
    runner = CliRunner()
    env = {"REMINDERS_DATABASE_URL": db_url, "REMINDERS_ENABLED": "false"}

    def run(*args: str, code: int = 0, **extra_env: str):
        result = runner.invoke(main, list(args), env={**env, **extra_env}, catch_exceptions=False)
        assert result.exit_code == code, result.output
        return result

    return run


def test_newcomer_flow_dry_run(cli, feeds):
    url = feeds.items("/feed.json", [item("standup", 3600 + 300), item("retro", 7200)])
    cli("db", "upgrade")
    put = json.loads(
        cli(
            "device",
            "put",
            "phone-1",
            "--apns-token",
            TOKEN,
            "--lead",
            "3600",
            "--rule",
            "lead:0@expiry",
            "--source",
            url,
        ).output
    )
    assert put["extra_rules"] == ["lead:0@expiry"] and put["source_urls"] == [url]
    built = json.loads(cli("build", "--all", "--now", NOW.stored).output)
    assert built["rows_inserted"] == 4 and built["devices_built"] == 1
    queued = json.loads(cli("queue", "list").output)
    assert {r["status"] for r in queued} == {"pending"} and len(queued) == 4
    drained = json.loads(cli("drain", "--now", str(NOW_S + 3600 + 400)).output)
    assert drained["outcomes"] == {"event_started": 1, "disabled": 1}
    assert (
        drained["lateness_seconds"]["max"] == 400
    )  # what a live run would have had: retro's lead:3600 came due 400 s before
    settled = json.loads(cli("queue", "list", "--status", "settled").output)
    assert [(r["item_id"].split(":")[1], r["outcome"]) for r in settled] == [
        ("standup", "event_started"),
        ("retro", "disabled"),
    ]
    devices = json.loads(cli("device", "list").output)
    assert devices[0]["reminders_built_at"] == NOW.stored
    removed = json.loads(cli("device", "remove", "phone-1").output)
    assert removed == {"removed": "phone-1", "rows_voided": 2}


def test_device_put_that_drops_a_calendar_voids_its_pending_rows(cli, feeds):
    a = feeds.items("/a.json", [item("a", 7200)])
    b = feeds.items("/b.json", [item("b", 7200)])
    cli("device", "put", "p", "--apns-token", TOKEN, "--source", a, "--source", b)
    cli("build", "--device", "p", "--now", NOW.stored)
    cli("device", "put", "p", "--apns-token", TOKEN, "--source", a)
    queued = json.loads(cli("queue", "list").output)
    assert sorted((r["item_id"].split(":")[1], r["status"], r["outcome_detail"]) for r in queued) == [
        ("a", "pending", None),
        ("b", "settled", "source_removed"),
    ]


def test_drain_single_row_by_id(cli, feeds):
    url = feeds.items("/feed.json", [item("a", 3600), item("b", 3600)])
    cli("device", "put", "p", "--apns-token", TOKEN, "--source", url)
    cli("build", "--device", "p", "--now", NOW.stored)
    first = json.loads(cli("queue", "list").output)[0]
    out = json.loads(cli("drain", "--id", str(first["id"]), "--now", at(0).stored).output)
    assert out["claimed"] == 1
    assert [r["status"] for r in json.loads(cli("queue", "list").output)] == ["settled", "pending"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["device", "put", "p", "--apns-token", "xyz"], "Invalid value for --apns-token"),
        (["device", "put", "p", "--apns-token", TOKEN, "--rule", "lead:-1"], "negative"),
        (["device", "put", "p", "--apns-token", TOKEN, "--rule", "lead:-1"], "Invalid value for --rule"),
        (["device", "put", "p", "--apns-token", TOKEN, "--tz", "Mars/Olympus"], "Invalid value for --tz"),
        (["device", "put", "p", "--apns-token", TOKEN, "--rule", "lead:5@end"], "unknown anchor"),
        (["device", "put", "p", "--apns-token", TOKEN, "--lead", "-5"], "--lead"),
        (["device", "put", "p", "--apns-token", TOKEN, "--source", "ftp://x/y"], "the ftp: scheme is refused"),
        (
            ["device", "put", "p", "--apns-token", TOKEN, "--source", "file:///etc/passwd"],
            "the file: scheme is refused",
        ),
        (["device", "put", "p", "--apns-token", TOKEN, "--source", "file:///etc/passwd"], "Invalid value for --source"),
        (["device", "put", "p", "--apns-token", TOKEN, "--source", "example.com/cal.ics"], "no scheme"),
        (["device", "put", "p", "--apns-token", TOKEN, "--source", "https:///cal.ics"], "with no host"),
        (["device", "put", "bad id!", "--apns-token", TOKEN], "Invalid value for DEVICE_ID"),
        (["build"], "exactly one of"),
        (["build", "--all", "--now", "yesterday"], "not an ISO-8601"),
        (["build", "--all", "--now", "2026-09-10T08:00:00"], "no UTC offset"),
        (["build", "--chunk", "99"], "chunks are"),
        (["drain", "--id", "0"], "--id"),
        (["queue", "list", "--status", "lost"], "lost"),
        (["device", "remove", "ghost"], "no device"),
        (["build", "--device", "ghost"], "no device 'ghost'"),
    ],
)
def test_bad_arguments_exit_2_with_a_message_and_write_nothing(cli, args, message):
    result = cli(*args, code=2)
    assert message in result.output
    assert json.loads(cli("device", "list").output) == []
    assert json.loads(cli("queue", "list").output) == []


def test_reading_commands_never_create_a_sqlite_ledger(tmp_path):
    """Only `reminders db upgrade` creates the ledger: every other command against a file that is
    not there exits 1 saying so, and leaves neither the file nor its directory behind."""
    target = tmp_path / "nowhere" / "ledger.sqlite3"
    runner = CliRunner()
    env = {"REMINDERS_DATABASE_URL": f"sqlite:///{target}"}
    for args in (["queue", "list"], ["device", "list"], ["sources"], ["build", "--all"], ["check"]):
        result = runner.invoke(main, args, env=env, catch_exceptions=False)
        assert result.exit_code == 1 and f"no ledger at {target}: run reminders db upgrade" in result.output, (
            args,
            result.output,
        )
        assert not target.parent.exists()
    assert runner.invoke(main, ["db", "upgrade"], env=env).exit_code == 0
    assert target.exists()


def test_bad_configuration_exits_2(cli):
    result = cli("device", "list", code=2, REMINDERS_MAX_LATENESS_SECONDS="soon")
    assert "REMINDERS_MAX_LATENESS_SECONDS" in result.output


def test_check_passes_on_defaults_and_names_each_broken_relationship(cli):
    ok = cli("check")
    assert "FAIL" not in ok.output
    broken = cli("check", code=1, REMINDERS_MAX_LATENESS_SECONDS="900", REMINDERS_DRAIN_CRON="*/30 * * * *")
    assert "FAIL max_lateness_covers_drain_cadence" in broken.output
    assert "broken: max_lateness_covers_drain_cadence" in broken.output


def test_check_knows_the_dispatcher_and_names_short_leads_when_it_is_off(cli):
    cli(
        "device",
        "put",
        "a",
        "--apns-token",
        TOKEN,
        "--rule",
        "lead:300",
        "--rule",
        "lead:0",
        "--rule",
        "lead:1800",
        "--rule",
        "lead:0@expiry",
    )
    cli("device", "put", "b", "--apns-token", TOKEN, "--lead", "3600", "--rule", "lead:600")
    assert "ok   short_leads_deliverable" in cli("check").output  # the dispatcher is on by default
    off = cli("check", code=1, REMINDERS_DISPATCH_ENABLED="false")
    (line,) = [s for s in off.output.splitlines() if s.startswith(("ok", "FAIL")) and "short_leads_deliverable" in s]
    # drain cadence 900 s + slack 300 s = 1200 s: every shorter lead, by name; lead:1800 and longer are fine
    assert line.startswith("FAIL") and line.endswith("lead:0, lead:0@expiry, lead:300, lead:600")
    assert "broken: short_leads_deliverable" in off.output


def test_check_fails_when_the_sweep_cannot_keep_up(cli):
    for i in range(30):
        cli("device", "put", f"d{i}", "--apns-token", TOKEN, REMINDERS_CHUNK_COUNT="1")
    out = cli("check", code=1, REMINDERS_CHUNK_COUNT="1", REMINDERS_CHUNK_SIZE="5")
    assert "FAIL sweep_period_within_lead" in out.output  # 6 visits x 15 min > 60 - 10 min
    assert "FAIL" not in cli("check", REMINDERS_CHUNK_COUNT="1", REMINDERS_CHUNK_SIZE="10").output


def test_check_notices_chunks_stored_under_another_chunk_count(cli):
    for i in range(30):
        cli("device", "put", f"d{i}", "--apns-token", TOKEN)
    out = cli("check", code=1, REMINDERS_CHUNK_COUNT="2")
    assert "FAIL stored_chunks_match_chunk_count" in out.output
    moved = json.loads(cli("device", "rechunk", REMINDERS_CHUNK_COUNT="2").output)
    assert moved["devices_moved"] > 0
    cli("check", REMINDERS_CHUNK_COUNT="2")


def test_the_installed_entry_point_runs(tmp_path: Path):
    exe = Path(sys.executable).with_name("reminders")
    env = {**os.environ, "REMINDERS_DATABASE_URL": f"sqlite:///{tmp_path}/x.sqlite3"}
    out = subprocess.run([str(exe), "db", "upgrade"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["revision"] == migrate.head_revision()
    bad = subprocess.run([str(exe), "drain", "--now", "nope"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not an ISO-8601" in bad.stderr


def test_prune_deletes_only_rows_settled_before_the_retention(cli, feeds):
    url = feeds.items("/feed.json", [item("a", 3600), item("b", 7200), item("c", 90_000)])
    cli("device", "put", "p", "--apns-token", TOKEN, "--source", url)
    cli("build", "--all", "--now", NOW.stored)
    cli("drain", "--now", at(0).stored)  # a settles (disabled)
    cli("drain", "--now", at(3600).stored)  # b settles an hour later
    out = json.loads(cli("prune", "--now", at(7 * 86400 + 1800).stored).output)
    assert out == {"deleted": 1, "retention_seconds": 7 * 86400}
    left = json.loads(cli("queue", "list").output)
    assert sorted(r["item_id"].split(":")[1] for r in left) == ["b", "c"]


def test_a_source_url_shows_no_secret_anywhere(cli, feeds, caplog):
    """Issue 19 item 12: userinfo, a secret path (Google's ``private-<token>``) and a query never
    leave the ledger: not in build summaries, the alert webhook, logs or ``sources``; the URL is
    shown as scheme, host and a stable id."""
    from reminders_pipeline.sources.urls import shown_url

    feeds.fail("/calendar/ical/private-p4thsecret/basic.ics?key=qu3rysecret", 503)
    url = feeds.url("/calendar/ical/private-p4thsecret/basic.ics?key=qu3rysecret").replace(
        "http://", "http://me:pa55secret@"
    )
    hook = feeds.url("/hook")
    cli("db", "upgrade")
    cli("device", "put", "phone-1", "--apns-token", TOKEN, "--source", url)
    env = {"REMINDERS_ALERT_WEBHOOK_URL": hook, "REMINDERS_SOURCE_ALERT_AFTER_SECONDS": "60"}
    results = [cli("build", "--all", "--now", at(minutes * 60).stored, **env) for minutes in (0, 15)]
    results.append(cli("sources"))
    outputs = [r.stdout for r in results]  # the JSON; a log line on stderr may interleave with .output
    shown = shown_url(url)
    assert (
        re.fullmatch(r"http://127\.0\.0\.1:\d+/…#[0-9a-f]{8}", shown)
        and shown_url(url.replace("p4th", "other")) != shown
    )
    assert json.loads(outputs[0])["sources_failed"] == [{"url": shown, "error": "http_503"}]
    assert json.loads(outputs[1])["sources_alerted"] == [shown]
    assert [s["url"] for s in json.loads(outputs[2])] == [shown]
    assert len(feeds.posts["/hook"]) == 1 and shown in feeds.posts["/hook"][0]["text"]
    everything = json.dumps([[r.output for r in results], feeds.posts["/hook"], caplog.text])
    assert not any(secret in everything for secret in ("pa55secret", "p4thsecret", "qu3rysecret", "private-"))


@pytest.mark.parametrize("command", [["demo", "--demo-port", "0"], ["dev", "--port", "0", "--demo-port", "0"]])
def test_a_blocked_upgrade_under_demo_or_dev_is_one_line_not_a_traceback(tmp_path, monkeypatch, command):
    """The quick start's commands upgrade the ledger first; an upgrade that cannot take its lock
    (``migrate.MigrationBlocked``, shown for real in test_schema) ends them with its own words."""

    def blocked(db, **_):
        raise migrate.MigrationBlocked("could not take a table lock after 5 attempts")

    monkeypatch.setattr(migrate, "upgrade", blocked)
    monkeypatch.chdir(tmp_path)
    env = {"REMINDERS_DATABASE_URL": f"sqlite:///{tmp_path}/ledger.sqlite3"}
    result = CliRunner().invoke(main, command, env=env)
    assert result.exit_code == 1, result.output
    assert "could not take a table lock" in result.output and "Traceback" not in result.output


def test_commands_typed_beside_reminders_dev_use_its_settings_and_say_so(tmp_path, monkeypatch):
    """`reminders dev` records its settings in ./var/dev.env; `reminders check` started in that
    folder judges the dev run's one chunk, not the default 16, and says whose settings it uses."""
    monkeypatch.chdir(tmp_path)
    _, settings, _ = dev_environment(tmp_path, {})
    db = Database(settings.database_url)
    migrate.upgrade(db)
    db.dispose()
    unset = {name: None for name in os.environ if name.startswith("REMINDERS_")}
    beside = CliRunner().invoke(main, ["check"], env=unset)
    assert "REMINDERS_CHUNK_COUNT 1 " in beside.output, beside.output
    assert f"with the settings of `reminders dev` in {tmp_path / 'var' / 'dev.env'}" in beside.stderr
    elsewhere = tmp_path / "other.sqlite3"
    other = CliRunner().invoke(
        main, ["db", "upgrade"], env={**unset, "REMINDERS_DATABASE_URL": f"sqlite:///{elsewhere}"}
    )
    assert other.exit_code == 0, other.output
    other = CliRunner().invoke(main, ["check"], env={**unset, "REMINDERS_DATABASE_URL": f"sqlite:///{elsewhere}"})
    assert "REMINDERS_CHUNK_COUNT 16 " in other.output and "reminders dev" not in other.stderr


def test_a_device_put_with_what_it_leaves_out_takes_the_deployments_defaults(cli):
    """The CLI and the HTTP route default through one constructor (``DeviceSpec.requested``): the
    lead of REMINDERS_DEFAULT_LEAD_SECONDS, the all-day rules unless --no-all-day-rules."""
    cli("device", "put", "p", "--apns-token", TOKEN, REMINDERS_DEFAULT_LEAD_SECONDS="1234")
    cli("device", "put", "q", "--apns-token", TOKEN, "--no-all-day-rules", REMINDERS_DEFAULT_LEAD_SECONDS="1234")
    shown = {d["id"]: d for d in json.loads(cli("device", "list").output)}
    assert shown["p"]["reminder_lead_seconds"] == shown["q"]["reminder_lead_seconds"] == 1234
    assert shown["p"]["all_day_rules"] == list(DEFAULT_ALL_DAY_RULES) and shown["q"]["all_day_rules"] == []


def test_a_dev_env_file_counts_only_while_its_run_runs_only_for_its_own_settings_and_only_if_yours(
    tmp_path, monkeypatch
):
    """A folder's ./var/dev.env must not switch on sending or point a provider elsewhere: only the
    settings `reminders dev` chooses are read, only while the run that wrote it is alive, and only
    from a file no one else could have written."""
    from reminders_pipeline.config import dev_run

    monkeypatch.chdir(tmp_path)
    ledger_url = f"sqlite:///{tmp_path / 'var' / 'dev.sqlite3'}"
    path = dev_run.write(tmp_path, {"REMINDERS_DATABASE_URL": ledger_url, "REMINDERS_CHUNK_COUNT": "1"})
    assert dev_run.with_dev_run({}, tmp_path)[0] == {"REMINDERS_DATABASE_URL": ledger_url, "REMINDERS_CHUNK_COUNT": "1"}

    dev_run.write(tmp_path, {"REMINDERS_DATABASE_URL": "postgresql+psycopg://u@db/r", "REMINDERS_CHUNK_COUNT": "1"})
    same = {"REMINDERS_DATABASE_URL": "postgres://u@db/r"}  # the same ledger, written as people do
    assert dev_run.with_dev_run(same, tmp_path)[0] == {**same, "REMINDERS_CHUNK_COUNT": "1"}
    other = {"REMINDERS_DATABASE_URL": "postgres://u@db/other"}
    assert dev_run.with_dev_run(other, tmp_path) == (other, None)
    path = dev_run.write(tmp_path, {"REMINDERS_DATABASE_URL": ledger_url, "REMINDERS_CHUNK_COUNT": "1"})

    with path.open("a") as f:  # a line someone added: not a setting reminders dev chooses
        f.write("REMINDERS_ENABLED=true\nREMINDERS_FCM_URL=https://elsewhere.example\n")
    assert "REMINDERS_ENABLED" not in dev_run.with_dev_run({}, tmp_path)[0]

    path.chmod(0o620)  # another user of the group could have written it
    assert dev_run.with_dev_run({}, tmp_path) == ({}, None)
    path.chmod(0o600)

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    text = path.read_text().replace(f"REMINDERS_DEV_RUN={os.getpid()} ", f"REMINDERS_DEV_RUN={gone.stdout.strip()} ")
    path.write_text(text)  # the run that wrote it has ended
    assert dev_run.with_dev_run({}, tmp_path) == ({}, None)

    dev_run.write(tmp_path, {"REMINDERS_CHUNK_COUNT": "1\rREMINDERS_ENABLED=true"})  # not printable: not kept
    assert dev_run.with_dev_run({}, tmp_path)[0] == {}
