"""What every scheduler, API and worker process shares: settings, SQL, Redis, Celery, process hygiene.

``settings`` (the one Settings object), ``db`` (engines, sessions, migrations), ``redis_client``
(one client per URL), ``redis_keys`` and ``queue_names`` (every name in one place), ``celery_app``
and ``broker`` (the Celery app and its Redis transport), ``beat_schedule`` (the periodic tasks),
``periodic_tick`` and ``tick_claims`` (each tick message runs once, never from a superseded
leadership), ``leader_lease`` (the fenced lease the beat elects its leader with), ``process`` (exit
of the Celery services) and ``gc_freeze`` (short full GCs after start-up).
"""
