"""What the operator sets and hears: settings from the environment, the cron cadences, alerts to a webhook, and log lines throttled while a step keeps failing."""
