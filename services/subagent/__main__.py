from services.subagent.main import main

main()
