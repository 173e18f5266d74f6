"""Jobs: requests answered later, their records, their Server-Sent Events, their webhooks, and the janitor
that deletes the reply subscriptions of API processes that died while waiting."""
