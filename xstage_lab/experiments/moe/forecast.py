"""The old name of ``python -m xstage_lab.analysis.moe.forecast`` (the forecast is CPU analysis of
records and lives there now); scripts that run this module keep working."""
from ...analysis.moe.forecast import main

if __name__ == "__main__":
    main()
