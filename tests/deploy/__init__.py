"""Tests of what ships: manifests, configuration file, image recipe and generated docs."""
