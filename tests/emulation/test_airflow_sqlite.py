"""The emulated Airflow's SQLite: ``now()`` has microseconds, as the DAG runs' ``run_after`` has, so a queued run
is due at once instead of at the next whole second (SQLite's ``CURRENT_TIMESTAMP``)."""

import re
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from trainguard.emulation import airflow_sqlite


def _engine() -> sa.Engine:
    return sa.create_engine("sqlite://", connect_args=airflow_sqlite.CONNECT_ARGS)


def test_now_on_sqlite_carries_the_fraction_of_a_second_in_sqlalchemys_datetime_layout():
    with _engine().connect() as conn:
        text = conn.execute(sa.select(sa.type_coerce(sa.func.now(), sa.String))).scalar_one()
        value = conn.execute(sa.select(sa.func.now())).scalar_one()  # read back as SQLAlchemy reads a datetime
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}", text), text  # CURRENT_TIMESTAMP has no fraction
    assert value >= datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f")  # the fraction read as microseconds
    assert abs((value.replace(tzinfo=UTC) - datetime.now(UTC)).total_seconds()) < 5  # UTC, as Airflow stores it


def test_a_run_due_a_millisecond_ago_is_due_now_within_the_same_second():
    meta = sa.MetaData()
    runs = sa.Table("dag_run", meta, sa.Column("id", sa.Integer, primary_key=True),
                    sa.Column("run_after", sa.DateTime))
    engine = _engine()
    meta.create_all(engine)
    due = datetime.now(UTC).replace(tzinfo=None) - timedelta(milliseconds=1)
    later = due + timedelta(seconds=30)
    with engine.begin() as conn:
        conn.execute(runs.insert(), [{"id": 1, "run_after": due}, {"id": 2, "run_after": later}])
        ready = conn.execute(sa.select(runs.c.id).where(runs.c.run_after <= sa.func.now())).scalars().all()
    assert ready == [1]


def test_other_databases_keep_their_own_now():
    from sqlalchemy.dialects import postgresql

    assert str(sa.select(sa.func.now()).compile(dialect=postgresql.dialect())) == "SELECT now() AS now_1"
