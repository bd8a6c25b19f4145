"""A run's configuration (docs/style.md rule 18): typed, validated once, then frozen.

Import each name from the module that defines it (this package re-exports nothing):
`sections` holds the sections' frozen dataclasses, RunConfig, the config hash and the tracking
URLs' environment fallback; `checks` reads YAML and KEY=VALUE overrides, coerces values to the
fields' types and checks names and the tracking section (raising ConfigError in the format of
docs/style.md rule 11); `validation` holds the cross-field checks of a whole config (`validate`);
`build` builds a run's config (`build_config`: merge, recommended settings, validate, freeze),
reports degenerate settings and rebuilds a stored run's config for `--resume`. Import direction:
sections <- checks <- validation <- build.
"""
