"""A run's configuration (docs/style.md rule 18): typed, validated once, then frozen.

Import each name from the module that defines it (this package re-exports nothing):
`sections` holds the sections' frozen dataclasses (each field declared once with `opt`: default,
help, choices, bounds), RunConfig, the config hash and the tracking URLs' environment fallback;
`checks` reads YAML and KEY=VALUE overrides, validates a section's or an algorithm's values through
pydantic (`validated`, `config_error`) and checks names and the tracking section (raising
ConfigError in the format of docs/style.md rule 11); `validation` holds the cross-field checks of a
whole config (`validate`); `build` builds a run's config (`build_config`: merge, recommended
settings, validate, freeze), reports degenerate settings and rebuilds a stored run's config for
`--resume`; `schema` writes the JSON Schemas of a run config and a sweep spec (docs/schema/).
Import direction: sections <- checks <- validation <- build; schema imports sections and checks.
"""
