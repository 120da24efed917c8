"""At its end, an agent that a scraper has visited twice keeps serving until one scrape has fetched its exit
marker, at risk (a live leak finding) or healthy: Prometheus then tells a clean end from a SIGKILL, and no
alert pages for it. One never scraped twice stops at once."""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.request

import pytest

from gpumemd.api import build_agent
from gpumemd.config import Config
from gpumemd.records.findings import Finding

SUSPECTED = Finding(kind="tensor_leak", series="host_rss_bytes", state="suspected", slope_bytes_per_step=1e6,
                    slope_low=9e5, slope_high=1.1e6, onset_step=50, growth_bytes=10**8, steps_to_oom=5000.0,
                    first_step=100, updated_step=100, summary="tensor leak suspected")
WAITING = "until a scrape records how the job ended"


def scrape(url: str, scraper: bool = True) -> str:
    """A GET of ``url``, as Prometheus sends it (with its scrape-timeout header), or as curl does."""
    headers = {"X-Prometheus-Scrape-Timeout-Seconds": "10"} if scraper else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
        return str(response.read().decode())


@pytest.mark.parametrize("at_risk", [True, False])
def test_the_last_scrape_carries_the_exit_marker(out_dir: str, at_risk: bool,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpumemd")
    agent = build_agent(Config(output_dir=out_dir, port=0, nvml=False, quiet=True, leak_detection=False,
                               census=False, sample_interval_s=0)).start()
    url = agent.exporter_url
    assert url is not None
    if at_risk:
        agent.publish(findings=(SUSPECTED,))
    scrape(url)
    scrape(url)  # the scraper's cadence is known: two scrapes
    stopping = threading.Thread(target=agent.stop)
    stopping.start()
    deadline = time.monotonic() + 10
    while WAITING not in caplog.text:
        assert time.monotonic() < deadline and stopping.is_alive()
        time.sleep(0.01)  # polling until the exporter waits for its last scrape (deadline above)
    last = scrape(url)
    run_id = f"{os.getpid()}-{round(agent.state().attached_at * 1000)}"
    assert ('gpumemd_agent_exit_timestamp_seconds{local_rank="0",rank="0",reason="exit",'
            f'run_id="{run_id}"}}') in last
    assert f'run_id="{run_id}"' in last.split("gpumemd_info{")[1].split("}")[0]  # the same run as it served
    stopping.join(timeout=10)
    assert not stopping.is_alive()


@pytest.mark.parametrize("scrapes", [(True,), (False, False, False)], ids=["once", "curl"])
def test_an_agent_no_scraper_came_to_twice_stops_at_once(out_dir: str, caplog: pytest.LogCaptureFixture,
                                                          scrapes: tuple[bool, ...]) -> None:
    caplog.set_level(logging.INFO, logger="gpumemd")
    agent = build_agent(Config(output_dir=out_dir, port=0, nvml=False, quiet=True, leak_detection=False,
                               census=False, sample_interval_s=0)).start()
    url = agent.exporter_url
    assert url is not None
    for scraper in scrapes:  # one scrape, or a person's curls: no scraper's cadence, nothing to wait for
        scrape(url, scraper)
    agent.stop()
    assert WAITING not in caplog.text
