"""A test session claims a block of ports no other session on the machine holds or listens on."""

from __future__ import annotations

import socket

from tests.port_blocks import _held, claim_port_block


def test_a_second_session_gets_the_next_block_while_the_first_holds_its_own(tmp_path):
    first = claim_port_block(tmp_path, candidates=(50000, 51000))
    second = claim_port_block(tmp_path, candidates=(50000, 51000))
    assert (first, second) == (50000, 51000)


def test_a_block_something_already_listens_on_is_skipped(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 52000 + 500 + 8085))  # the block's second worker's Pub/Sub port
        squatter.listen()
        assert claim_port_block(tmp_path, candidates=(52000, 53000)) == 53000


def test_when_every_block_is_taken_the_first_is_named_and_the_stack_reports_the_clash(tmp_path):
    held = len(_held)
    claim_port_block(tmp_path, candidates=(54000,))
    assert claim_port_block(tmp_path, candidates=(54000,)) == 54000
    assert len(_held) == held + 1  # only the first claim holds a lock
