"""trainguard registers itself with Airflow as a provider: its provider info passes Airflow's own schema, the
installed distribution's ``apache_airflow_provider`` entry point leads to it, and Airflow's providers manager then
offers ``NodeHook`` and ``FleetHook`` under connection types of trainguard's own, leaving the SSH provider's ``ssh``
type to ``SSHHook``."""

from __future__ import annotations

from importlib import metadata

from trainguard.operators.provider_info import CONN_TYPE, FLEET_CONN_TYPE, get_provider_info


def test_the_provider_info_passes_airflows_schema_and_names_the_distribution():
    from airflow.providers_manager import _create_provider_info_schema_validator

    info = get_provider_info()
    _create_provider_info_schema_validator().validate(info)
    assert info["package-name"] == metadata.distribution("trainguard").metadata["Name"]
    assert [c["connection-type"] for c in info["connection-types"]] == [CONN_TYPE, FLEET_CONN_TYPE]


def test_the_installed_distribution_points_airflow_at_it():
    eps = [ep for ep in metadata.entry_points(group="apache_airflow_provider") if ep.dist.name == "trainguard"]
    assert len(eps) == 1 and eps[0].load() is get_provider_info


def test_airflow_offers_the_node_hook_under_trainguards_own_type():
    from airflow.providers_manager import ProvidersManager

    from trainguard.operators.hooks.fleet import FleetHook
    from trainguard.operators.hooks.node import NodeHook

    pm = ProvidersManager()
    assert "trainguard" in pm.providers
    hooks = pm.hooks
    assert hooks[CONN_TYPE].hook_class_name == "trainguard.operators.hooks.node.NodeHook"
    assert NodeHook.conn_type == CONN_TYPE and FleetHook.conn_type == FLEET_CONN_TYPE
    assert hooks[FLEET_CONN_TYPE].hook_class_name == "trainguard.operators.hooks.fleet.FleetHook"
    # the SSH provider's type stays its own
    assert hooks["ssh"].hook_class_name == "airflow.providers.ssh.hooks.ssh.SSHHook"
    behaviour = pm.field_behaviours[CONN_TYPE]
    assert {"host", "port", "password"} <= set(behaviour["hidden_fields"])
