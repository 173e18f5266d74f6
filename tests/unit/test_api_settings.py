"""The API's settings: per-key limits parse strictly, and their defaults depend on the environment."""

from __future__ import annotations

import pytest

from contract.digits import ascii_digits
from contract.settings import PRODUCTION_RATE_LIMIT, Settings


def test_key_limits_map_digests_to_rate_and_concurrency():
    digest = "a" * 64
    settings = Settings.from_env({"MAAS_KEY_LIMITS": f"{digest.upper()}=120/4, {'b' * 64}=0/0"})
    assert settings.key_limits == {digest: (120, 4), "b" * 64: (0, 0)}


@pytest.mark.parametrize("value", ["abc=1/1", f"{'a' * 64}=1", f"{'a' * 64}=x/1", f"{'a' * 64}=-1/1"])
def test_malformed_key_limits_are_refused(value):
    with pytest.raises(ValueError, match="MAAS_KEY_LIMITS"):
        Settings.from_env({"MAAS_KEY_LIMITS": value})


def test_limits_default_to_unlimited_locally_and_to_a_guard_in_production():
    assert (Settings.from_env({}).rate_limit_per_minute, Settings.from_env({}).concurrency_limit) == (0, 0)
    production = Settings.from_env({"MAAS_ENV": "production", "MAAS_API_KEY_SHA256": "a" * 64})
    assert production.rate_limit_per_minute == PRODUCTION_RATE_LIMIT and production.concurrency_limit > 0
    assert Settings.from_env({"MAAS_RATE_LIMIT_PER_MINUTE": "0", "MAAS_ENV": "production"}).rate_limit_per_minute == 0


def test_janitor_is_off_by_default_and_its_age_defaults_past_the_longest_request_timeout():
    from api_server.jobs.janitor import janitor_age, longest_request_timeout

    settings = Settings.from_env({})
    catalog = settings.catalog()
    assert settings.janitor_interval_seconds == 0
    assert janitor_age(settings, catalog) == longest_request_timeout(catalog) + 600
    configured = Settings.from_env({"MAAS_JANITOR_INTERVAL_SECONDS": "600", "MAAS_JANITOR_OLDER_THAN_SECONDS": "3600"})
    assert configured.janitor_interval_seconds == 600 and janitor_age(configured, catalog) == 3600
    with pytest.raises(ValueError, match="live waits"):
        janitor_age(Settings.from_env({"MAAS_JANITOR_OLDER_THAN_SECONDS": "100"}), catalog)


@pytest.mark.parametrize("text", ["\u00b9", "\u00b2\u00b3", "12\u00b9", "", "-1", "1.5"])
def test_only_ascii_digits_count_as_a_whole_number(text):
    # A superscript is a digit to str.isdigit() and a ValueError to int(): it must be refused before int().
    assert not ascii_digits(text)
    with pytest.raises(ValueError, match="MAAS_KEY_LIMITS"):
        Settings.from_env({"MAAS_KEY_LIMITS": f"{'a' * 64}={text or 'x'}/1"})


def test_ascii_digits_are_a_whole_number():
    assert ascii_digits("0") and ascii_digits("1795801520551")


def test_the_publish_timeout_defaults_to_ten_seconds_and_is_bounded():
    assert Settings.from_env({}).publish_timeout_seconds == 10
    assert Settings.from_env({"MAAS_PUBLISH_TIMEOUT_SECONDS": "60"}).publish_timeout_seconds == 60
    for wrong in ("0", "61"):
        with pytest.raises(ValueError, match="MAAS_PUBLISH_TIMEOUT_SECONDS must be 1 to 60"):
            Settings.from_env({"MAAS_PUBLISH_TIMEOUT_SECONDS": wrong})
