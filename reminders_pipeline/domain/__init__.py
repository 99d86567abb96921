"""The domain: pure values and rules with no I/O. Times and zones, reminder rules, feed items, a calendar's settings, an alert's words, the send-time policy and the notification a row becomes."""
