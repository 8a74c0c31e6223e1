"""Developer tools that sit above the installed library and are not installed with it (pyproject.toml's
package list leaves them out): run them from the repository root, e.g. `python -m tools.build_demo_pair`."""
