"""Entry point of the group ``verl.plugins`` (pyproject.toml): ``import verl`` imports this module, which installs
:mod:`otb_ref.integrations.verl`. verl hides a plugin's load error at DEBUG level, so the tests check the
registration in a fresh interpreter."""

from otb_ref.integrations.verl import install

install()
