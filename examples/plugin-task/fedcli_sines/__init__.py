"""Example fedcli plugin: the `sines` task and the `sine-cnn` model (docs/bring-your-own.md, "Plugins")."""
