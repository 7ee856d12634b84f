#pragma once
// The parsed form of a chat template (chat_template.h): expression and statement trees, made by
// chat_template_parse.cpp and walked by chat_template.cpp.

#include "difftrain/models/tokenizers/chat_template.h"

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

namespace difftrain::models::jinja {

using Json = nlohmann::ordered_json;

struct Expr;
using ExprPtr = std::shared_ptr<const Expr>;

/// One expression node. `text` is the name (kName, kAttr, kFilter, kTest, kCall's keyword names
/// live in `keywords`), the operator (kBinary, kUnary, kCompare) or unused.
struct Expr {
  enum class Kind {
    kLiteral,   // value
    kName,      // text
    kList,      // args: the items
    kDict,      // args: key, value, key, value, ...
    kAttr,      // args[0].text
    kItem,      // args[0][args[1]]
    kSlice,     // args[0][args[1]:args[2]:args[3]] (null pointers for omitted parts)
    kCall,      // args[0](args[1..], keywords)
    kFilter,    // args[0] | text(args[1..], keywords)
    kTest,      // args[0] is [not] text (args[1..]); negated
    kUnary,     // text in {"not", "-", "+"}, args[0]
    kBinary,    // args[0] text args[1]: + - * / // % ** ~ and or
    kCompare,   // args[0] text args[1]: == != < <= > >= in "not in"
    kCondition  // args[1] if args[0] else args[2] (args[2] may be null)
  };
  Kind kind = Kind::kLiteral;
  std::string text;
  Json value;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> keywords;
  bool negated = false;
  int line = 0;
};

struct Stmt;
using Body = std::vector<std::shared_ptr<const Stmt>>;

/// One statement node.
struct Stmt {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // conditions[i] -> bodies[i]; else_body
    kFor,       // for targets in expr [if condition]: body; else_body
    kSet,       // set targets (or target.attr) = expr
    kSetBlock,  // set targets[0] %} body {% endset
    kBreak,
    kContinue,
    kGeneration  // {% generation %} body {% endgeneration %}: the body
  };
  Kind kind = Kind::kText;
  std::string text;
  ExprPtr expr;
  ExprPtr condition;
  std::vector<std::string> targets;
  std::string attribute;  // kSet on `ns.attr`
  std::vector<ExprPtr> conditions;
  std::vector<Body> bodies;
  Body body;
  Body else_body;
  int line = 0;
};

}  // namespace difftrain::models::jinja

namespace difftrain::models {

struct ChatTemplate::Impl {
  std::string source;
  std::string origin;
  jinja::Body body;
};

namespace jinja {
/// Parses `source` into statements; errors name `origin` and the line.
Body parse(const std::string& source, const std::string& origin);
}  // namespace jinja

}  // namespace difftrain::models
