"""The build asset and the drain job run in process on SQLite and PostgreSQL ledgers."""

from __future__ import annotations

from collections import Counter

import dagster as dg

from reminders_pipeline import ledger
from reminders_pipeline.defs.build import RANGE_END_TAG, RANGE_START_TAG
from reminders_pipeline.planning.build import build
from reminders_pipeline.providers.base import SendResult

from .support import TOKEN, rows
from .test_dagster_support import (
    RECORDER,
    AlertReceiver,
    add_device,
    definitions_for,
    device_in_chunk,
    live_item,
    resources_for,
)


def materialized(instance: dg.DagsterInstance) -> set[str]:
    return set(instance.get_materialized_partitions(dg.AssetKey("notification_queue")))


def built_at(db) -> dict[str, str | None]:
    with db.read() as conn:
        return {d.id: d.reminders_built_at for d in ledger.list_devices(conn)}


def test_materializing_chunks_builds_exactly_their_devices(db, settings, db_url, feeds, instance):
    url = feeds.items("/a.json", [live_item("e1", 7200), live_item("e2", 9000)])
    one, three, five = device_in_chunk(1), device_in_chunk(3), device_in_chunk(5)
    for device_id in (one, three, five):
        add_device(db, settings, device_id, [url])
    job = definitions_for(resources_for(db_url)).resolve_job_def("build_notification_queue")

    single = job.execute_in_process(partition_key="001", instance=instance)
    assert single.success and materialized(instance) == {"001"}
    assert [d for d, at in built_at(db).items() if at] == [one]

    # One run for a range of chunks (BackfillPolicy.single_run), metadata per chunk.
    ranged = job.execute_in_process(tags={RANGE_START_TAG: "002", RANGE_END_TAG: "004"}, instance=instance)
    assert ranged.success and materialized(instance) == {"001", "002", "003", "004"}
    assert {d for d, at in built_at(db).items() if at} == {one, three}
    events = {e.partition: e.metadata for e in ranged.asset_materializations_for_node("notification_queue")}
    assert set(events) == {"002", "003", "004"}
    assert events["003"]["devices_built"].value == 1 and events["003"]["rows_inserted"].value == 2
    assert events["002"]["devices_built"].value == 0
    assert events["003"]["oldest_reminders_built_at"].value == built_at(db)[three].stored
    assert len(rows(db, device_id=three)) == 2 and rows(db, device_id=five) == []


def due_rows(db, settings, feeds, n: int, path: str = "/due.json") -> None:
    """``n`` rows whose lead:3600 came due a minute ago (events start in 59 minutes)."""
    url = feeds.items(path, [live_item(f"e{i}", 3600 - 60) for i in range(n)])
    add_device(db, settings, device_in_chunk(0), [url])
    build(db, settings)


def outcome_counts(db) -> Counter:
    return Counter(r["outcome"] for r in rows(db))


def test_drain_job_dry_run_settles_disabled_with_summary_metadata(db, settings, db_url, feeds, instance):
    due_rows(db, settings, feeds, 3)
    result = definitions_for(resources_for(db_url)).resolve_job_def("drain_job").execute_in_process(instance=instance)
    assert result.success
    assert outcome_counts(db) == {"disabled": 3}
    meta = result.output_for_node("summarize")
    assert meta["outcomes"] == {"disabled": 3} and meta["due"] == 3 and meta["claimed"] == 3
    out_meta = next(e for e in result.all_events if e.step_key == "summarize" and e.event_type_value == "STEP_OUTPUT")
    entries = out_meta.event_specific_data.metadata
    assert entries["outcome_disabled"].value == 3 and entries["outcome_sent"].value == 0
    assert entries["outcomes_by_rule_kind"].value == {"lead:disabled": 3}
    assert entries["outcomes_by_provider"].value == {"apns:disabled": 3}
    assert entries["lateness_max_seconds"].value >= 0  # what a live run would have had, from send_after to the claim


def test_drain_job_live_sends_in_bounded_batches_and_reports_lateness(
    db, settings, db_url, feeds, instance, monkeypatch
):
    due_rows(db, settings, feeds, 30)
    monkeypatch.setenv("REMINDERS_DRAIN_BATCH_SIZE", "10")
    monkeypatch.setenv("REMINDERS_DRAIN_MAX_BATCHES", "2")
    RECORDER.sent.clear()
    result = (
        definitions_for(resources_for(db_url, live=True))
        .resolve_job_def("drain_job")
        .execute_in_process(instance=instance)
    )
    assert result.success
    send_steps = {e.step_key for e in result.all_events if e.step_key and e.step_key.startswith("send_batch[")}
    assert send_steps == {"send_batch[batch_000]", "send_batch[batch_001]"}  # 30 rows, at most 2 batches
    assert outcome_counts(db) == {"sent": 30} and len(RECORDER.sent) == 30
    claimers = {r["claimed_by"] for r in rows(db)}
    assert claimers == {f"{result.run_id}:batch_000", f"{result.run_id}:batch_001"}
    summary = result.output_for_node("summarize")
    assert summary["outcomes"] == {"sent": 30}
    assert 55 <= summary["lateness_seconds"]["p50"] <= 120


def test_drain_job_with_row_id_drains_only_that_row(db, settings, db_url, feeds, instance):
    due_rows(db, settings, feeds, 3)
    target = rows(db)[1]["id"]
    result = (
        definitions_for(resources_for(db_url))
        .resolve_job_def("drain_job")
        .execute_in_process(run_config={"ops": {"find_due": {"config": {"row_id": target}}}}, instance=instance)
    )
    assert result.success
    assert {r["id"]: r["status"] for r in rows(db)} == {
        r["id"]: "settled" if r["id"] == target else "pending" for r in rows(db)
    }


def test_drain_job_with_nothing_due_still_summarizes(db_url, instance):
    result = definitions_for(resources_for(db_url)).resolve_job_def("drain_job").execute_in_process(instance=instance)
    assert result.success
    assert result.output_for_node("summarize")["due"] == 0


def test_an_apns_configuration_fault_halts_the_run_after_one_batch_with_one_alert(
    db, settings, db_url, feeds, instance, monkeypatch
):
    due_rows(db, settings, feeds, 30)
    monkeypatch.setenv("REMINDERS_DRAIN_BATCH_SIZE", "10")
    RECORDER.sent.clear()
    RECORDER.script[TOKEN] = SendResult(0, False, reason="InvalidProviderToken", status=403, config_fault=True)
    try:
        with AlertReceiver() as receiver:
            result = (
                definitions_for(resources_for(db_url, live=True, webhook=receiver.url))
                .resolve_job_def("drain_job")
                .execute_in_process(instance=instance, raise_on_error=False)
            )
    finally:
        RECORDER.script.clear()
    assert not result.success  # summarize fails the run: red in the UI, and the run-failure alert
    assert len(RECORDER.sent) == 10  # batch 1 probed APNs; batches 2 and 3 never did
    assert Counter(r["status"] for r in rows(db)) == {"settled": 10, "pending": 20}
    assert receiver.titles() == ["[reminders] APNs configuration fault: drain stopped claiming its rows"]
