"""What only a real S3 server can show (moto takes any credentials): the session's
SeaweedFS checks every request's signature, and the S3 tier meets a refusal as a miss
that says nothing about the object, never as a crash or a corrupt object."""

from __future__ import annotations

import os
import uuid

import boto3
import pytest
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError

from tiercache.config import S3TierConfig
from tiercache.tiers.format import ObjectHeader, checksum
from tiercache.tiers.s3.tier import Fetch, S3Tier

from support.s3_blocks import fetch_block, put_block

SLOT = 8192


def client(endpoint: str, **credentials):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **credentials)


def test_the_real_server_refuses_a_wrong_secret_and_an_unsigned_request(real_s3_endpoint, real_bucket):
    signed = client(real_s3_endpoint)
    signed.put_object(Bucket=real_bucket, Key="probe", Body=b"x")
    wrong = client(
        real_s3_endpoint,
        aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],  # the server's own key id
        aws_secret_access_key="not-the-secret",
    )
    with pytest.raises(ClientError) as refused:
        wrong.get_object(Bucket=real_bucket, Key="probe")
    assert refused.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    unsigned = client(real_s3_endpoint, config=Config(signature_version=UNSIGNED))
    with pytest.raises(ClientError) as anonymous:
        unsigned.put_object(Bucket=real_bucket, Key="anonymous", Body=b"x")
    assert anonymous.value.response["Error"]["Code"] == "AccessDenied"
    assert [o["Key"] for o in signed.list_objects_v2(Bucket=real_bucket)["Contents"]] == ["probe"]


def test_a_wrong_secret_is_a_miss_that_leaves_the_object(real_s3_endpoint, real_bucket, monkeypatch):
    config = S3TierConfig(bucket=real_bucket, endpoint_url=real_s3_endpoint, region="us-east-1")
    key = f"{uuid.uuid4().hex[:16]}/{uuid.uuid4().hex * 2}"
    data = memoryview(bytes(range(256)) * (SLOT // 256))
    writer = S3Tier(config)
    stored = put_block(writer, ObjectHeader(key, key[:16], SLOT, checksum(data)), data)
    assert stored is not None

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")  # boto3's chain, read per client
    refused = S3Tier(config)
    try:
        out = memoryview(bytearray(SLOT))
        # Refused: neither missing nor corrupt, so nothing is deleted or unindexed.
        assert fetch_block(refused, stored, out) is Fetch.UNAVAILABLE
        assert put_block(refused, ObjectHeader(key, key[:16], SLOT, checksum(data)), data) is None
        assert not refused.ping()
    finally:
        refused.close()

    out = memoryview(bytearray(SLOT))
    assert fetch_block(writer, stored, out) is Fetch.OK and bytes(out) == bytes(data)
    writer.close()
