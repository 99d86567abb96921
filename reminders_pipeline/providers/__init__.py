"""The push providers as equals: what the drain hands a provider and gets back (``base``), which provider a row goes to (``routing``), and APNs, Web Push and FCM each in their own module."""
