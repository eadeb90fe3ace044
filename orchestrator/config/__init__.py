"""Configuration: the inventory file, ssh_config, the code tree to sync, and the files shipped
beside the code (docker/)."""
