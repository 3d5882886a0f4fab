"""One way to S3 for the control plane: the ``tg_s3`` connection's endpoint, keys and client; a task that needs
it says plainly when it is missing; a tool outside Airflow falls back to its own environment."""

from __future__ import annotations

import json

import pytest

from trainguard.operators.hooks.s3 import S3ConnectionMissing, conn_id, s3_access


def test_the_connection_gives_the_endpoint_the_client_and_the_machines_credentials(monkeypatch, s3_endpoint):
    import boto3

    monkeypatch.setenv("AIRFLOW_CONN_TG_S3", json.dumps({
        "conn_type": "aws", "login": "conn-key", "password": "conn-secret",
        "extra": {"endpoint_url": s3_endpoint, "region_name": "eu-west-1"}}))
    monkeypatch.setenv("TG_S3_ENDPOINT_URL", "http://127.0.0.1:9")  # the process's: not used
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket="access-check")
    access = s3_access(required=True)
    assert access.source == "connection tg_s3" and access.endpoint_url == s3_endpoint
    assert access.env == {"AWS_ACCESS_KEY_ID": "conn-key", "AWS_SECRET_ACCESS_KEY": "conn-secret",
                          "AWS_DEFAULT_REGION": "eu-west-1"}
    assert "access-check" in [b["Name"] for b in access.client.list_buckets()["Buckets"]]


def test_another_connection_is_named_in_the_environment(monkeypatch):
    monkeypatch.setenv("TG_S3_CONN_ID", "store_b")
    monkeypatch.setenv("AIRFLOW_CONN_STORE_B", json.dumps({"conn_type": "aws", "login": "b", "password": "bb"}))
    assert conn_id() == "store_b" and s3_access().source == "connection store_b"


def test_a_missing_connection_is_named_where_it_is_required_and_the_environment_stands_in_elsewhere(monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_TG_S3", raising=False)
    monkeypatch.setenv("TG_S3_CONN_ID", "tg_s3_nowhere")
    with pytest.raises(S3ConnectionMissing, match=r"the S3 connection 'tg_s3_nowhere' is not defined: add an "
                                                  r"Airflow connection of type aws named tg_s3_nowhere"):
        s3_access(required=True)
    monkeypatch.setenv("TG_S3_ENDPOINT_URL", "http://store.example:9000")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "process-key")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    access = s3_access()
    assert access.source == "environment" and access.client is None
    assert access.endpoint_url == "http://store.example:9000" and access.env["AWS_ACCESS_KEY_ID"] == "process-key"
