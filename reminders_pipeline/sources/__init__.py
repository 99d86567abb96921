"""Reading what users subscribe: the bounded HTTP reader, the egress guard that keeps reads outside the deployment, and iCalendar turned into items."""
