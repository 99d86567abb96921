"""The send half: claim each due row right before sending it, apply the policy, send through the device's provider, settle; the dispatcher sends each row at its own ``send_after``."""
