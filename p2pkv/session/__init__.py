"""The session protocol (:mod:`.protocol`, sans-IO) and its Trio driver (:mod:`.session`)."""
