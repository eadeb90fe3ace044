"""Job images on the hosts: facts, shipping without a registry, host-to-host chains."""
