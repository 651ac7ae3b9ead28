from benchmarks.report.build import main

raise SystemExit(main())
