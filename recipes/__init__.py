raise ModuleNotFoundError(
    "recipes/ is not an importable package. Recipes are scripts: run one with "
    "`minippo run <recipe> --config <config>`, or copy it with `minippo cp <recipe> <dest>` and edit it."
)
