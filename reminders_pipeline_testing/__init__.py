"""Test doubles and harnesses shared by the suite (``reminders_pipeline_tests``) and the benchmarks
(``bench/``): the mock APNs, throwaway PostgreSQL databases, Dagster and Celery processes.

Neither the tests nor the benchmarks own them, so ``bench/`` never imports a test module.
"""
